//! What the dynamic loader reads of a little-endian ELF64 file, from its program headers and
//! dynamic section (section headers may be stripped): its loader (PT_INTERP), SONAME, DT_NEEDED,
//! RUNPATH/RPATH and the newest `GLIBC_x.y` among its version needs. Files here come from images
//! and users, so every part read is bounded ([`PART_MAX`]) and a bad offset ends the read with
//! an error, never a panic or an unbounded allocation. Used by the lazy Prolog prefetch (which
//! files a program loads) and by the host-MPI ABI check (berth-node's `mpi`).

use std::fs::File;
use std::os::unix::fs::FileExt;

/// The largest ELF part (program headers, dynamic section, string table) read.
pub const PART_MAX: u64 = 4 << 20;
/// Version need entries (and auxiliary entries of each) followed at most.
const VERNEED_MAX: u64 = 256;

/// What the loader reads of one ELF file.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Dynamic {
    /// PT_INTERP: the program's loader (executables only).
    pub interp: Option<String>,
    pub soname: Option<String>,
    pub needed: Vec<String>,
    /// DT_RUNPATH then DT_RPATH directories, `$ORIGIN` left as written.
    pub search: Vec<String>,
    /// The newest `GLIBC_x.y` among its version needs.
    pub glibc: Option<(u32, u32)>,
}

/// Reads `file`'s loader, SONAME, needs, search path and glibc version need. A static file (no
/// PT_DYNAMIC) has only its loader, if any.
pub fn read(file: &File) -> Result<Dynamic, String> {
    const PT_LOAD: u32 = 1;
    const PT_DYNAMIC: u32 = 2;
    const PT_INTERP: u32 = 3;
    const DT_NEEDED: u64 = 1;
    const DT_STRTAB: u64 = 5;
    const DT_STRSZ: u64 = 10;
    const DT_SONAME: u64 = 14;
    const DT_RPATH: u64 = 15;
    const DT_RUNPATH: u64 = 29;
    const DT_VERNEED: u64 = 0x6fff_fffe;
    const DT_VERNEEDNUM: u64 = 0x6fff_ffff;
    let bad = |what: &str| format!("not a little-endian ELF64 library ({what})");
    let header = bytes_at(file, 0, 64)?;
    if header.get(..6) != Some(b"\x7fELF\x02\x01".as_slice()) {
        return Err(bad("header"));
    }
    let phoff = u64_at(&header, 0x20).ok_or_else(|| bad("e_phoff"))?;
    let phentsize = u16_at(&header, 0x36).ok_or_else(|| bad("e_phentsize"))?;
    let phnum = u16_at(&header, 0x38).ok_or_else(|| bad("e_phnum"))?;
    if phentsize < 56 {
        return Err(bad("e_phentsize"));
    }
    let phdrs = bytes_at(file, phoff, u64::from(phentsize) * u64::from(phnum))?;
    // (p_type, p_offset, p_vaddr, p_filesz)
    let headers: Vec<(u32, u64, u64, u64)> = phdrs
        .chunks_exact(usize::from(phentsize))
        .filter_map(|p| Some((u32_at(p, 0)?, u64_at(p, 8)?, u64_at(p, 16)?, u64_at(p, 32)?)))
        .collect();
    let mut out = Dynamic {
        interp: match headers.iter().find(|(t, ..)| *t == PT_INTERP) {
            Some(&(_, off, _, size)) => c_str(&bytes_at(file, off, size)?, 0),
            None => None,
        },
        ..Dynamic::default()
    };
    let Some(&(_, dyn_off, _, dyn_size)) = headers.iter().find(|(t, ..)| *t == PT_DYNAMIC) else {
        return Ok(out); // static: no dynamic section
    };
    let to_offset = |vaddr: u64| {
        headers
            .iter()
            .find(|(t, _, va, sz)| *t == PT_LOAD && *va <= vaddr && vaddr - va < *sz)
            .map(|(_, off, va, _)| off + (vaddr - va))
    };
    let dynamic = bytes_at(file, dyn_off, dyn_size)?;
    let entries: Vec<(u64, u64)> = dynamic
        .chunks_exact(16)
        .filter_map(|e| Some((u64_at(e, 0)?, u64_at(e, 8)?)))
        .take_while(|(tag, _)| *tag != 0)
        .collect();
    let tag = |t: u64| entries.iter().find(|(k, _)| *k == t).map(|(_, v)| *v);
    let strtab_at = tag(DT_STRTAB)
        .and_then(to_offset)
        .ok_or_else(|| bad("DT_STRTAB"))?;
    let strtab = bytes_at(
        file,
        strtab_at,
        tag(DT_STRSZ).ok_or_else(|| bad("DT_STRSZ"))?,
    )?;
    out.soname = tag(DT_SONAME).and_then(|o| c_str(&strtab, o));
    out.needed = entries
        .iter()
        .filter(|(k, _)| *k == DT_NEEDED)
        .filter_map(|(_, o)| c_str(&strtab, *o))
        .collect();
    out.search = [DT_RUNPATH, DT_RPATH]
        .into_iter()
        .filter_map(tag)
        .filter_map(|o| c_str(&strtab, o))
        .flat_map(|s| s.split(':').map(str::to_string).collect::<Vec<_>>())
        .filter(|d| !d.is_empty())
        .collect();
    if let (Some(mut at), Some(count)) = (tag(DT_VERNEED).and_then(to_offset), tag(DT_VERNEEDNUM)) {
        // Each Elf64_Verneed (16 bytes) heads a chain of Elf64_Vernaux (16 bytes); bounded by
        // the counts the file gives and by a sane maximum.
        for _ in 0..count.min(VERNEED_MAX) {
            let need = bytes_at(file, at, 16)?;
            let cnt = u16_at(&need, 2).ok_or_else(|| bad("vn_cnt"))?;
            let mut aux_at = at + u64::from(u32_at(&need, 8).ok_or_else(|| bad("vn_aux"))?);
            for _ in 0..u64::from(cnt).min(VERNEED_MAX) {
                let aux = bytes_at(file, aux_at, 16)?;
                let name = c_str(
                    &strtab,
                    u64::from(u32_at(&aux, 8).ok_or_else(|| bad("vna"))?),
                );
                if let Some(v) = name.as_deref().and_then(glibc_version_name) {
                    out.glibc = out.glibc.max(Some(v));
                }
                let next = u32_at(&aux, 12).ok_or_else(|| bad("vna_next"))?;
                if next == 0 {
                    break;
                }
                aux_at += u64::from(next);
            }
            let next = u32_at(&need, 12).ok_or_else(|| bad("vn_next"))?;
            if next == 0 {
                break;
            }
            at += u64::from(next);
        }
    }
    Ok(out)
}

/// `(2, 34)` of `GLIBC_2.34` (and of `GLIBC_2.2.5`).
pub fn glibc_version_name(name: &str) -> Option<(u32, u32)> {
    let mut parts = name.strip_prefix("GLIBC_")?.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

fn bytes_at(file: &File, offset: u64, len: u64) -> Result<Vec<u8>, String> {
    if len > PART_MAX {
        return Err(format!("an ELF part of {len} bytes (over {PART_MAX})"));
    }
    let mut buf = vec![0; usize::try_from(len).map_err(|e| e.to_string())?];
    file.read_exact_at(&mut buf, offset)
        .map_err(|e| format!("reading {len} bytes at {offset}: {e}"))?;
    Ok(buf)
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn c_str(b: &[u8], at: u64) -> Option<String> {
    let rest = b.get(usize::try_from(at).ok()?..)?;
    let end = rest.iter().position(|c| *c == 0)?;
    String::from_utf8(rest[..end].to_vec()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_program_has_a_loader_and_needs_and_text_is_refused() {
        let sh = std::fs::canonicalize("/bin/sh").unwrap();
        let d = read(&File::open(&sh).unwrap()).unwrap();
        assert!(
            d.interp.as_deref().is_some_and(|i| i.contains("ld-linux")),
            "{d:?}"
        );
        assert!(d.needed.iter().any(|n| n == "libc.so.6"), "{d:?}");
        assert!(d.glibc.is_some_and(|v| v >= (2, 2)), "{d:?}");
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("text"), [b'x'; 100]).unwrap();
        let e = read(&File::open(dir.path().join("text")).unwrap()).unwrap_err();
        assert!(e.contains("not a little-endian ELF64 library"), "{e}");
        assert_eq!(glibc_version_name("GLIBC_2.2.5"), Some((2, 2)));
        assert_eq!(glibc_version_name("GLIBC_PRIVATE"), None);
    }

    #[test]
    fn a_header_that_lies_about_its_parts_is_an_error() {
        let sh = std::fs::read(std::fs::canonicalize("/bin/sh").unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        // e_phoff past the end, then e_phnum * e_phentsize over PART_MAX.
        let mut far = sh.clone();
        far[0x20..0x28].copy_from_slice(&u64::MAX.to_le_bytes());
        let mut huge = sh;
        huge[0x36..0x38].copy_from_slice(&u16::MAX.to_le_bytes());
        huge[0x38..0x3a].copy_from_slice(&u16::MAX.to_le_bytes());
        for (name, bytes) in [("far", far), ("huge", huge)] {
            let path = dir.path().join(name);
            std::fs::write(&path, bytes).unwrap();
            read(&File::open(&path).unwrap()).unwrap_err();
        }
    }
}
