//! Keyed fingerprints: how a secret (a cache salt, a tenant id) appears in logs and metrics.
//!
//! A fingerprint is SipHash-2-4 of the secret under a 128-bit key, cut to 48 bits and printed as
//! 12 hex digits. SipHash is a pseudo-random function under a secret key, so a fingerprint cannot
//! be reversed or brute-forced from a dictionary of likely tenant names without the key. Replicas
//! that share the key (configured) print the same fingerprint for the same tenant; without a
//! configured key each process draws a random one.
//!
//! Invariant: nothing in this module, or any type holding a secret, ever formats the secret.

use std::fmt;
use std::hash::Hasher;

use siphasher::sip::SipHasher24;

/// The secret key fingerprints are computed under.
#[derive(Clone)]
pub struct FingerprintKey([u8; 16]);

impl FingerprintKey {
    /// A key from configuration (e.g. a Secret shared by all replicas).
    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        FingerprintKey(bytes)
    }

    /// Derives a key from an arbitrary configured string.
    pub fn from_passphrase(passphrase: &str) -> Self {
        let a = xxhash_rust::xxh3::xxh3_128_with_seed(passphrase.as_bytes(), 0x6b76_6570_70ff);
        FingerprintKey(a.to_le_bytes())
    }

    /// A fresh random key for this process.
    pub fn random() -> Self {
        FingerprintKey(rand::random())
    }

    /// The fingerprint of `secret` under this key.
    pub fn fingerprint(&self, secret: &[u8]) -> Fingerprint {
        let mut h = SipHasher24::new_with_key(&self.0);
        h.write(secret);
        Fingerprint(h.finish() >> 16)
    }
}

impl fmt::Debug for FingerprintKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FingerprintKey(<redacted>)")
    }
}

/// A 48-bit keyed fingerprint, printed as 12 lowercase hex digits. Safe to log and to use as a
/// metric label.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(u64);

impl Fingerprint {
    /// The fingerprint as a number (48 significant bits).
    pub fn value(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:012x}", self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "fp:{self}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_and_stable() {
        let k1 = FingerprintKey::from_passphrase("replica-shared");
        let k2 = FingerprintKey::from_passphrase("replica-shared");
        let k3 = FingerprintKey::from_passphrase("other");
        assert_eq!(k1.fingerprint(b"tenant-a"), k2.fingerprint(b"tenant-a"));
        assert_ne!(k1.fingerprint(b"tenant-a"), k3.fingerprint(b"tenant-a"));
        assert_ne!(k1.fingerprint(b"tenant-a"), k1.fingerprint(b"tenant-b"));
        let shown = k1.fingerprint(b"tenant-a").to_string();
        assert_eq!(shown.len(), 12);
        assert!(!format!("{:?}", k1).contains("replica"));
    }
}
