//! Loop devices: exposes a byte range of a file (a `.sqsh`, or a SIF's squashfs partition at its
//! offset) as a read-only block device the kernel can mount. Devices are taken from
//! `/dev/loop-control` and configured with `LOOP_CONFIGURE` (Linux 5.8+; `LOOP_SET_FD` +
//! `LOOP_SET_STATUS64` before that) with `LO_FLAGS_AUTOCLEAR`: the kernel detaches a device
//! when its last user goes, so an unmounted image frees its device without berth's help, even
//! if berth was killed.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;

// From <linux/loop.h>; the libc crate does not define them.
const LOOP_SET_FD: libc::c_ulong = 0x4C00;
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_SET_STATUS64: libc::c_ulong = 0x4C04;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_NAME_SIZE: usize = 64;
const LOOP_MAJOR: u32 = 7;
/// Attempts when other processes take the free device first.
const ATTACH_ATTEMPTS: usize = 64;

/// Attaching a file to a loop device failed; the store names the image file
/// ([`crate::ImageError::Loop`]).
#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    #[error("opening /dev/loop-control: {0} (berth needs root and the loop driver: modprobe loop)")]
    Control(std::io::Error),
    #[error("no free loop device: {0}")]
    NoFree(Errno),
    #[error("opening {path}: {source}")]
    Device {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("opening {path}: {source}")]
    Backing {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("configuring {device} for {file}: {errno}")]
    Configure {
        device: PathBuf,
        file: PathBuf,
        errno: Errno,
    },
    #[error("every free loop device was taken by other processes {ATTACH_ATTEMPTS} times in a row")]
    Contended,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// An attached loop device. Keep it until the file system on it is mounted: with autoclear,
/// closing the last handle of an unmounted device detaches it.
#[derive(Debug)]
pub struct LoopDevice {
    pub path: PathBuf,
    pub number: u32,
    device: File,
}

fn info(file: &Path, offset: u64, size: u64, flags: u32) -> LoopInfo64 {
    let mut name = [0u8; LO_NAME_SIZE];
    let bytes = file.as_os_str().as_encoded_bytes();
    let n = bytes.len().min(LO_NAME_SIZE - 1);
    name[..n].copy_from_slice(&bytes[..n]);
    LoopInfo64 {
        lo_device: 0,
        lo_inode: 0,
        lo_rdevice: 0,
        lo_offset: offset,
        lo_sizelimit: size,
        lo_number: 0,
        lo_encrypt_type: 0,
        lo_encrypt_key_size: 0,
        lo_flags: flags,
        lo_file_name: name,
        lo_crypt_name: [0; LO_NAME_SIZE],
        lo_encrypt_key: [0; 32],
        lo_init: [0; 2],
    }
}

/// The node of loop device `n`, created when /dev has none (a /dev without udev or devtmpfs).
fn device_node(n: u32) -> Result<PathBuf, LoopError> {
    let path = PathBuf::from(format!("/dev/loop{n}"));
    if path.exists() {
        return Ok(path);
    }
    let (major, minor) = std::fs::read_to_string(format!("/sys/block/loop{n}/dev"))
        .ok()
        .and_then(|s| {
            let (a, b) = s.trim().split_once(':')?;
            Some((a.parse().ok()?, b.parse().ok()?))
        })
        .unwrap_or((LOOP_MAJOR, n));
    match nix::sys::stat::mknod(
        &path,
        nix::sys::stat::SFlag::S_IFBLK,
        nix::sys::stat::Mode::from_bits_truncate(0o660),
        nix::sys::stat::makedev(u64::from(major), u64::from(minor)),
    ) {
        Ok(()) | Err(Errno::EEXIST) => Ok(path),
        Err(e) => Err(LoopError::Device {
            path,
            source: e.into(),
        }),
    }
}

fn ioctl_ptr<T>(fd: &File, request: libc::c_ulong, arg: *const T) -> Result<libc::c_int, Errno> {
    // SAFETY: each caller passes a request whose argument is a pointer to T (a live, properly
    // sized repr(C) struct) or, for the requests taking an integer, a small integer cast to a
    // pointer that the kernel never dereferences.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request, arg) };
    Errno::result(r)
}

/// How a device is configured; [`LoopDevice::attach`] tries the first and falls back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `LOOP_CONFIGURE`: one atomic call (Linux 5.8+).
    Configure,
    /// `LOOP_SET_FD` then `LOOP_SET_STATUS64`, for older kernels.
    SetFd,
}

impl LoopDevice {
    /// Attaches `size` bytes of `file` starting at `offset`, read-only, with autoclear.
    pub fn attach(file: &Path, offset: u64, size: u64) -> Result<LoopDevice, LoopError> {
        Self::attach_with(file, offset, size, Method::Configure)
    }

    /// [`Self::attach`] starting with `method` (tests use it to exercise the fallback).
    pub fn attach_with(
        file: &Path,
        offset: u64,
        size: u64,
        method: Method,
    ) -> Result<LoopDevice, LoopError> {
        let backing = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(file)
            .map_err(|source| LoopError::Backing {
                path: file.to_path_buf(),
                source,
            })?;
        Self::attach_fd(&backing, file, offset, size, method)
    }

    /// Attaches `size` bytes from `offset` of the open `backing` file (opened by the user who
    /// named it: the device reads that very file, whatever is renamed at its path later),
    /// read-only, with autoclear. `file` is only the name shown in sysfs and errors.
    pub fn attach_fd(
        backing: &File,
        file: &Path,
        offset: u64,
        size: u64,
        method: Method,
    ) -> Result<LoopDevice, LoopError> {
        let control = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/loop-control")
            .map_err(LoopError::Control)?;
        let flags = LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR;
        for _ in 0..ATTACH_ATTEMPTS {
            #[expect(
                clippy::cast_sign_loss,
                reason = "ioctl_ptr turns a negative result into an error"
            )]
            let n = ioctl_ptr::<u8>(&control, LOOP_CTL_GET_FREE, std::ptr::null())
                .map_err(LoopError::NoFree)? as u32;
            let path = device_node(n)?;
            let device = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
                .map_err(|source| LoopError::Device {
                    path: path.clone(),
                    source,
                })?;
            let config = LoopConfig {
                // An open file's fd is never negative.
                fd: backing.as_raw_fd().cast_unsigned(),
                block_size: 0,
                info: info(file, offset, size, flags),
                reserved: [0; 8],
            };
            let configure_err = |errno| LoopError::Configure {
                device: path.clone(),
                file: file.to_path_buf(),
                errno,
            };
            if method == Method::Configure {
                match ioctl_ptr(&device, LOOP_CONFIGURE, &config) {
                    Ok(_) => {
                        return Ok(LoopDevice {
                            path,
                            number: n,
                            device,
                        });
                    }
                    // Another process configured this free device first: take the next one.
                    Err(Errno::EBUSY) => continue,
                    // Kernels before 5.8 lack LOOP_CONFIGURE.
                    Err(Errno::EINVAL | Errno::ENOTTY) => {}
                    Err(e) => return Err(configure_err(e)),
                }
            }
            match ioctl_ptr::<u8>(
                &device,
                LOOP_SET_FD,
                // The fd is passed as the ioctl's argument; an open file's fd is never negative.
                backing.as_raw_fd().cast_unsigned() as usize as *const u8,
            ) {
                Ok(_) => {}
                Err(Errno::EBUSY) => continue,
                Err(e) => return Err(configure_err(e)),
            }
            let dev = LoopDevice {
                path: path.clone(),
                number: n,
                device,
            };
            // The read-only flag comes from the O_RDONLY backing file with LOOP_SET_FD; it is
            // asked for again so that a writable fd still gives a read-only device.
            let status = info(file, offset, size, LO_FLAGS_AUTOCLEAR | LO_FLAGS_READ_ONLY);
            if let Err(e) = ioctl_ptr(&dev.device, LOOP_SET_STATUS64, &status) {
                dev.detach();
                return Err(configure_err(e));
            }
            return Ok(dev);
        }
        Err(LoopError::Contended)
    }

    /// Detaches the device now (after a failed mount).
    pub fn detach(self) {
        if let Err(e) = ioctl_ptr::<u8>(&self.device, LOOP_CLR_FD, std::ptr::null()) {
            tracing::debug!("detaching {}: {e}", self.path.display());
        }
    }
}

/// The file a loop device is attached to and at what offset, from sysfs; `None` once it is
/// detached.
pub fn backing(number: u32) -> Option<(PathBuf, u64)> {
    let dir = PathBuf::from(format!("/sys/block/loop{number}/loop"));
    let file = std::fs::read_to_string(dir.join("backing_file")).ok()?;
    let offset = std::fs::read_to_string(dir.join("offset"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some((PathBuf::from(file.trim_end_matches('\n')), offset))
}

/// Whether loop device `number` is read-only and set to autoclear, from sysfs.
pub fn flags(number: u32) -> Option<(bool, bool)> {
    let read = |p: String| std::fs::read_to_string(p).ok().map(|s| s.trim() == "1");
    Some((
        read(format!("/sys/block/loop{number}/ro"))?,
        read(format!("/sys/block/loop{number}/loop/autoclear"))?,
    ))
}

/// The loop device number of a `/dev/loopN` path.
pub fn number(device: &Path) -> Option<u32> {
    device.to_str()?.strip_prefix("/dev/loop")?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_layouts_match_linux_loop_h() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }

    #[test]
    fn names_and_numbers() {
        assert_eq!(number(Path::new("/dev/loop12")), Some(12));
        assert_eq!(number(Path::new("/dev/sda")), None);
        let long = PathBuf::from(format!("/{}", "x".repeat(100)));
        let i = info(&long, 4096, 8192, LO_FLAGS_AUTOCLEAR);
        assert_eq!(i.lo_file_name[62], b'x');
        assert_eq!(i.lo_file_name[63], 0, "NUL-terminated");
        assert_eq!((i.lo_offset, i.lo_sizelimit), (4096, 8192));
    }
}
