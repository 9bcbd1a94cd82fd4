//! How berth processes prove to each other that they hold the cluster key without ever sending
//! it: every request (agent heartbeats, `berth cluster`, Raft RPCs between controllers, catalog
//! lookups, peer blob fetches, pre-warm requests) carries an HMAC-SHA256 under the key, and every
//! answer to a verified request carries one too. A process that merely holds a berth port (a
//! local user who bound it after the agent stopped) learns nothing from a request and cannot
//! forge an answer the client accepts.
//!
//! The request header, [`AUTH_HEADER`]:
//!
//! ```text
//! X-Berth-Auth: v1 ts=<unix seconds> nonce=<32 hex> body=<sha256 hex of the body> mac=<64 hex>
//! mac = HMAC-SHA256(key, "berth-request-v1\n" METHOD "\n" PATH?QUERY "\n" ts "\n" nonce "\n" body)
//! ```
//!
//! The body's hash is in the header, under the MAC, so a server authenticates a request from its
//! head alone, before it reads a byte of the body (an unauthenticated peer never gets a body
//! buffered), and then checks the body against the hash. A server refuses a timestamp more than
//! [`SKEW`] from its clock and a nonce it saw within that window ([`ReplayCache`]).
//!
//! The answer header, [`PROOF_HEADER`], only on answers to a verified request:
//!
//! ```text
//! X-Berth-Proof: v1 mac=<64 hex>
//! mac = HMAC-SHA256(key, "berth-answer-v1\n" nonce "\n" status "\n" tag)
//! ```
//!
//! `tag` is [`body_tag`] (the sha256 of the answer's body), or for a blob that is streamed,
//! [`blob_tag`] (its digest and the Content-Length sent): a blob's bytes are checked against its
//! digest by the client anyway. The nonce binds the answer to the request; a client refuses an
//! answer without a valid proof, whatever its status.
//!
//! The key is the key file's content, surrounding whitespace trimmed (a trailing newline from
//! `echo` must not make two nodes disagree).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// The request header that proves the sender holds the key.
pub const AUTH_HEADER: &str = "x-berth-auth";
/// The answer header that proves the server holds the key.
pub const PROOF_HEADER: &str = "x-berth-proof";
/// How far (seconds) a request's timestamp may be from the server's clock.
pub const SKEW: u64 = 60;
/// Nonces a server remembers; past this the oldest are dropped and requests no newer than the
/// newest dropped one are refused (a replay cache that cannot grow without bound).
pub const REPLAY_MAX: usize = 100_000;

const VERSION: &str = "v1";
const NONCE_BYTES: usize = 16;

type HmacSha256 = Hmac<Sha256>;

/// Why a request or an answer was refused, one line each.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("no {AUTH_HEADER} header: sign requests with the cluster key (berth_api::auth)")]
    Missing,
    #[error("the {0} header is malformed")]
    Malformed(&'static str),
    #[error(
        "the request's timestamp is {0} s from this server's clock (at most {SKEW}): \
         check the nodes' clocks (NTP)"
    )]
    Skew(u64),
    #[error("the request's MAC is wrong: the sender does not hold this cluster key")]
    BadMac,
    #[error("the request was seen before (a replay)")]
    Replay,
    #[error("the request's body does not match the hash it was signed with")]
    BodyMismatch,
    #[error(
        "the answer carries no {PROOF_HEADER}: the server does not hold the cluster key (a \
         process that is not berth's may hold its port)"
    )]
    NoProof,
    #[error(
        "the answer's {PROOF_HEADER} is wrong: the server does not hold the cluster key (a \
         process that is not berth's may hold its port)"
    )]
    BadProof,
    #[error("no random bytes for a nonce: {0}")]
    Random(String),
}

/// The cluster key. Its `Debug` never shows it.
#[derive(Clone)]
pub struct Key(Vec<u8>);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

impl Key {
    /// The key of a key file's content.
    pub fn new(file_content: &str) -> Self {
        Self(file_content.trim().as_bytes().to_vec())
    }

    fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.0).expect("HMAC takes a key of any length")
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The sha256 of `body`, in hex: the body field of a request and the tag of a small answer.
pub fn body_tag(body: &[u8]) -> String {
    hex(&Sha256::digest(body))
}

/// The tag of a streamed blob answer: its digest and the Content-Length sent.
pub fn blob_tag(digest: &str, content_length: u64) -> String {
    format!("blob {digest} {content_length}")
}

/// Seconds since the epoch by this machine's clock.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn request_mac(
    key: &Key,
    method: &str,
    path: &str,
    ts: u64,
    nonce: &str,
    body: &str,
) -> HmacSha256 {
    let mut m = key.mac();
    m.update(
        format!("berth-request-{VERSION}\n{method}\n{path}\n{ts}\n{nonce}\n{body}").as_bytes(),
    );
    m
}

/// A signed request: the header value to send, and the nonce its answer's proof must cover.
#[derive(Debug, Clone)]
pub struct Signed {
    pub header: String,
    pub nonce: String,
}

/// Signs a request of `method` to `path` (with its query) carrying `body` (empty for none).
pub fn sign_request(key: &Key, method: &str, path: &str, body: &[u8]) -> Result<Signed, AuthError> {
    let mut n = [0u8; NONCE_BYTES];
    getrandom::fill(&mut n).map_err(|e| AuthError::Random(e.to_string()))?;
    Ok(sign_request_at(
        key,
        method,
        path,
        &body_tag(body),
        now(),
        &hex(&n),
    ))
}

/// [`sign_request`] with the body's hash, time and nonce given.
pub fn sign_request_at(
    key: &Key,
    method: &str,
    path: &str,
    body_sha256: &str,
    ts: u64,
    nonce: &str,
) -> Signed {
    let mac = request_mac(key, method, path, ts, nonce, body_sha256)
        .finalize()
        .into_bytes();
    Signed {
        header: format!(
            "{VERSION} ts={ts} nonce={nonce} body={body_sha256} mac={}",
            hex(&mac)
        ),
        nonce: nonce.to_string(),
    }
}

/// A request head that verified: the nonce to prove the answer with, and the body hash the
/// body must have ([`Verified::check_body`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub nonce: String,
    body_sha256: String,
}

impl Verified {
    /// Whether `body` is the body the request was signed with.
    pub fn check_body(&self, body: &[u8]) -> Result<(), AuthError> {
        self.check_body_hash(&body_tag(body))
    }

    /// [`Verified::check_body`] with the body's sha256 (hex) computed by the caller.
    pub fn check_body_hash(&self, sha256_hex: &str) -> Result<(), AuthError> {
        let same: bool = sha256_hex.len() == self.body_sha256.len()
            && sha256_hex
                .bytes()
                .zip(self.body_sha256.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0;
        if same {
            Ok(())
        } else {
            Err(AuthError::BodyMismatch)
        }
    }

    /// Whether the request has no body (the hash of nothing).
    pub fn body_is_empty(&self) -> bool {
        self.check_body(b"").is_ok()
    }
}

struct Fields<'a> {
    ts: u64,
    nonce: &'a str,
    body: &'a str,
    mac: Vec<u8>,
}

fn parse(header: &str) -> Option<Fields<'_>> {
    let mut words = header.split_ascii_whitespace();
    if words.next()? != VERSION {
        return None;
    }
    let (mut ts, mut nonce, mut body, mut mac) = (None, None, None, None);
    for w in words {
        let (k, v) = w.split_once('=')?;
        match k {
            "ts" => ts = Some(v.parse().ok()?),
            "nonce" => nonce = Some(v),
            "body" => body = Some(v),
            "mac" => mac = Some(unhex(v)?),
            _ => return None,
        }
    }
    let nonce =
        nonce.filter(|n| n.len() >= 2 * NONCE_BYTES && n.len() <= 128 && unhex(n).is_some())?;
    let body = body.filter(|b| b.len() == 64 && unhex(b).is_some())?;
    Some(Fields {
        ts: ts?,
        nonce,
        body,
        mac: mac?,
    })
}

/// Verifies a request head: `header` (the [`AUTH_HEADER`] value, `None` when absent) against
/// `method`, `path` (with its query), this server's clock `now` and its replay cache. The body is
/// checked after, with [`Verified::check_body`].
pub fn verify_request(
    key: &Key,
    header: Option<&str>,
    method: &str,
    path: &str,
    now: u64,
    seen: &ReplayCache,
) -> Result<Verified, AuthError> {
    let header = header.ok_or(AuthError::Missing)?;
    let f = parse(header).ok_or(AuthError::Malformed(AUTH_HEADER))?;
    let skew = now.abs_diff(f.ts);
    if skew > SKEW {
        return Err(AuthError::Skew(skew));
    }
    request_mac(key, method, path, f.ts, f.nonce, f.body)
        .verify_slice(&f.mac)
        .map_err(|_| AuthError::BadMac)?;
    // Only after the MAC: a nonce only a key holder could have sent takes a place in the cache.
    seen.check_and_insert(f.ts, f.nonce, now)?;
    Ok(Verified {
        nonce: f.nonce.to_string(),
        body_sha256: f.body.to_string(),
    })
}

fn answer_mac(key: &Key, nonce: &str, status: u16, tag: &str) -> HmacSha256 {
    let mut m = key.mac();
    m.update(format!("berth-answer-{VERSION}\n{nonce}\n{status}\n{tag}").as_bytes());
    m
}

/// The [`PROOF_HEADER`] value of an answer with `status` and `tag` to the request of `nonce`.
pub fn sign_answer(key: &Key, nonce: &str, status: u16, tag: &str) -> String {
    let mac = answer_mac(key, nonce, status, tag).finalize().into_bytes();
    format!("{VERSION} mac={}", hex(&mac))
}

/// Verifies an answer's proof (`header`, `None` when absent) for the request of `nonce`.
pub fn verify_answer(
    key: &Key,
    header: Option<&str>,
    nonce: &str,
    status: u16,
    tag: &str,
) -> Result<(), AuthError> {
    let header = header.ok_or(AuthError::NoProof)?;
    let mac = header
        .strip_prefix(VERSION)
        .and_then(|r| r.trim_start().strip_prefix("mac="))
        .and_then(|m| unhex(m.trim()))
        .ok_or(AuthError::BadProof)?;
    answer_mac(key, nonce, status, tag)
        .verify_slice(&mac)
        .map_err(|_| AuthError::BadProof)
}

/// The nonces a server saw within the skew window, bounded by [`REPLAY_MAX`].
#[derive(Debug, Default)]
pub struct ReplayCache {
    inner: Mutex<Replay>,
}

#[derive(Debug, Default)]
struct Replay {
    seen: BTreeSet<(u64, String)>,
    /// Requests with a timestamp at or below this are refused: nonces that old were dropped
    /// to keep the cache bounded, so a replay of one could not be told.
    floor: Option<u64>,
    max: usize,
}

impl ReplayCache {
    /// A cache of at most `max` nonces.
    pub fn with_capacity(max: usize) -> Self {
        Self {
            inner: Mutex::new(Replay {
                max: max.max(1),
                ..Replay::default()
            }),
        }
    }

    fn check_and_insert(&self, ts: u64, nonce: &str, now: u64) -> Result<(), AuthError> {
        let mut r = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let max = if r.max == 0 { REPLAY_MAX } else { r.max };
        // A timestamp outside the window is refused anyway: its nonce need not be kept.
        let oldest = now.saturating_sub(SKEW);
        while r.seen.first().is_some_and(|(t, _)| *t < oldest) {
            r.seen.pop_first();
        }
        if r.floor.is_some_and(|f| ts <= f) {
            return Err(AuthError::Replay);
        }
        let entry = (ts, nonce.to_string());
        if r.seen.contains(&entry) {
            return Err(AuthError::Replay);
        }
        r.seen.insert(entry);
        while r.seen.len() > max {
            if let Some((t, _)) = r.seen.pop_first() {
                r.floor = Some(r.floor.map_or(t, |f| f.max(t)));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONCE: &str = "00112233445566778899aabbccddeeff";

    fn key() -> Key {
        Key::new("secret key\n")
    }

    fn signed(path: &str, body: &[u8], ts: u64, nonce: &str) -> String {
        sign_request_at(&key(), "POST", path, &body_tag(body), ts, nonce).header
    }

    #[test]
    fn a_signed_request_verifies_once_and_never_carries_the_key() {
        let s = sign_request(&key(), "POST", "/v1/heartbeat", b"{}").unwrap();
        assert!(!s.header.contains("secret"));
        let seen = ReplayCache::default();
        let v = verify_request(
            &key(),
            Some(&s.header),
            "POST",
            "/v1/heartbeat",
            now(),
            &seen,
        )
        .unwrap();
        assert_eq!(v.nonce, s.nonce);
        v.check_body(b"{}").unwrap();
        assert_eq!(v.check_body(b"{ }"), Err(AuthError::BodyMismatch));
        // The same header again: a replay.
        assert_eq!(
            verify_request(
                &key(),
                Some(&s.header),
                "POST",
                "/v1/heartbeat",
                now(),
                &seen
            ),
            Err(AuthError::Replay)
        );
        // Whitespace around the key file's content is not part of the key.
        let seen = ReplayCache::default();
        let h = sign_request(&Key::new("secret key"), "GET", "/x", b"").unwrap();
        verify_request(&key(), Some(&h.header), "GET", "/x", now(), &seen).unwrap();
    }

    #[test]
    fn tampered_requests_are_refused() {
        let t = 1_000_000;
        let h = signed("/v1/drain", b"body", t, NONCE);
        let v = |h: &str, method: &str, path: &str| {
            verify_request(&key(), Some(h), method, path, t, &ReplayCache::default())
        };
        v(&h, "POST", "/v1/drain").unwrap();
        assert_eq!(v(&h, "POST", "/v1/resume"), Err(AuthError::BadMac));
        assert_eq!(v(&h, "GET", "/v1/drain"), Err(AuthError::BadMac));
        assert_eq!(v(&h, "POST", "/v1/drain?x=1"), Err(AuthError::BadMac));
        let swap = |from: &str, to: &str| h.replacen(from, to, 1);
        assert_eq!(
            v(
                &swap(&format!("ts={t}"), &format!("ts={}", t + 1)),
                "POST",
                "/v1/drain"
            ),
            Err(AuthError::BadMac)
        );
        assert_eq!(
            v(&swap(NONCE, &NONCE.replace('0', "1")), "POST", "/v1/drain"),
            Err(AuthError::BadMac)
        );
        assert_eq!(
            v(
                &swap(&body_tag(b"body"), &body_tag(b"other")),
                "POST",
                "/v1/drain"
            ),
            Err(AuthError::BadMac)
        );
        let wrong = sign_request_at(
            &Key::new("other"),
            "POST",
            "/v1/drain",
            &body_tag(b"body"),
            t,
            NONCE,
        );
        assert_eq!(
            v(&wrong.header, "POST", "/v1/drain"),
            Err(AuthError::BadMac)
        );
        assert_eq!(
            verify_request(&key(), None, "GET", "/", t, &ReplayCache::default()),
            Err(AuthError::Missing)
        );
        for bad in [
            "Bearer secret key",
            "v1 ts=1",
            "v2 ts=1 nonce=a body=b mac=c",
            "",
        ] {
            assert_eq!(
                v(bad, "POST", "/v1/drain"),
                Err(AuthError::Malformed(AUTH_HEADER)),
                "{bad}"
            );
        }
        // A nonce too short to be random.
        let short = signed("/v1/drain", b"body", t, "0011");
        assert_eq!(
            v(&short, "POST", "/v1/drain"),
            Err(AuthError::Malformed(AUTH_HEADER))
        );
    }

    #[test]
    fn timestamps_far_from_the_clock_are_refused() {
        let t = 1_000_000;
        let seen = ReplayCache::default();
        for (ts, ok) in [
            (t - SKEW, true),
            (t + SKEW, true),
            (t - SKEW - 1, false),
            (t + SKEW + 1, false),
        ] {
            let nonce = format!("{NONCE}{ts:08x}");
            let h = signed("/p", b"", ts, &nonce);
            let r = verify_request(&key(), Some(&h), "POST", "/p", t, &seen);
            assert_eq!(r.is_ok(), ok, "{ts}: {r:?}");
            if !ok {
                assert!(matches!(r, Err(AuthError::Skew(_))));
            }
        }
    }

    #[test]
    fn the_replay_cache_stays_bounded_and_refuses_what_it_dropped() {
        let seen = ReplayCache::with_capacity(2);
        let t = 1_000_000;
        let n = |i: u64| format!("{NONCE}{i:04}");
        seen.check_and_insert(t, &n(1), t).unwrap();
        seen.check_and_insert(t + 1, &n(2), t).unwrap();
        seen.check_and_insert(t + 2, &n(3), t).unwrap();
        // n(1) was dropped: anything at its time or before is refused, not let through twice.
        assert_eq!(seen.check_and_insert(t, &n(1), t), Err(AuthError::Replay));
        assert_eq!(seen.check_and_insert(t, &n(9), t), Err(AuthError::Replay));
        assert_eq!(
            seen.check_and_insert(t + 2, &n(3), t),
            Err(AuthError::Replay)
        );
        seen.check_and_insert(t + 2, &n(4), t).unwrap();
        // Nonces older than the window leave the cache as the clock moves.
        let later = t + 10 * SKEW;
        seen.check_and_insert(later, &n(5), later).unwrap();
        assert_eq!(seen.inner.lock().unwrap().seen.len(), 1);
    }

    #[test]
    fn answers_prove_the_key_for_their_request_only() {
        let p = sign_answer(&key(), NONCE, 200, &body_tag(b"{}"));
        assert!(!p.contains("secret"));
        verify_answer(&key(), Some(&p), NONCE, 200, &body_tag(b"{}")).unwrap();
        let other = NONCE.replace('0', "1");
        for (nonce, status, body) in [
            (other.as_str(), 200, &b"{}"[..]),
            (NONCE, 401, b"{}"),
            (NONCE, 200, b"{ }"),
        ] {
            assert_eq!(
                verify_answer(&key(), Some(&p), nonce, status, &body_tag(body)),
                Err(AuthError::BadProof)
            );
        }
        assert_eq!(
            verify_answer(&Key::new("other"), Some(&p), NONCE, 200, &body_tag(b"{}")),
            Err(AuthError::BadProof)
        );
        assert_eq!(
            verify_answer(&key(), None, NONCE, 200, &body_tag(b"{}")),
            Err(AuthError::NoProof)
        );
        assert_eq!(
            verify_answer(&key(), Some("v1 mac=zz"), NONCE, 200, ""),
            Err(AuthError::BadProof)
        );
        let d = format!("sha256:{}", "a".repeat(64));
        let b = sign_answer(&key(), NONCE, 206, &blob_tag(&d, 10));
        verify_answer(&key(), Some(&b), NONCE, 206, &blob_tag(&d, 10)).unwrap();
        assert!(verify_answer(&key(), Some(&b), NONCE, 206, &blob_tag(&d, 11)).is_err());
    }
}
