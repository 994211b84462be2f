//! Worker identity: one model-server endpoint and one data-parallel rank.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

/// A routable worker: the endpoint Envoy sends traffic to, plus the data-parallel rank whose KV
/// cache the events describe. Displays as `ip:port` (rank 0) or `ip:port#rank`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId {
    /// The endpoint (`ip:port`) written into `x-gateway-destination-endpoint`.
    pub endpoint: SocketAddr,
    /// The data-parallel rank behind that endpoint.
    pub dp_rank: u32,
}

impl WorkerId {
    /// A rank-0 worker.
    pub fn new(endpoint: SocketAddr) -> Self {
        WorkerId {
            endpoint,
            dp_rank: 0,
        }
    }

    /// A fixed 22-byte encoding (IPv6-mapped address, port, rank), the same in every process:
    /// what hashes of a worker (rendezvous weights, digests) are computed over.
    pub fn key_bytes(&self) -> [u8; 22] {
        let mut out = [0u8; 22];
        let ip = match self.endpoint.ip() {
            std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
            std::net::IpAddr::V6(v6) => v6.octets(),
        };
        out[..16].copy_from_slice(&ip);
        out[16..18].copy_from_slice(&self.endpoint.port().to_le_bytes());
        out[18..22].copy_from_slice(&self.dp_rank.to_le_bytes());
        out
    }

    /// A worker for one data-parallel rank.
    pub fn with_rank(endpoint: SocketAddr, dp_rank: u32) -> Self {
        WorkerId { endpoint, dp_rank }
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.dp_rank == 0 {
            write!(f, "{}", self.endpoint)
        } else {
            write!(f, "{}#{}", self.endpoint, self.dp_rank)
        }
    }
}

/// Why a worker id could not be parsed.
#[derive(Debug, thiserror::Error)]
#[error("invalid worker `{0}`: expected ip:port or ip:port#rank")]
pub struct WorkerIdError(String);

impl FromStr for WorkerId {
    type Err = WorkerIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || WorkerIdError(s.to_owned());
        let (addr, rank) = match s.rsplit_once('#') {
            Some((a, r)) => (a, r.parse().map_err(|_| err())?),
            None => (s, 0),
        };
        Ok(WorkerId {
            endpoint: addr.parse().map_err(|_| err())?,
            dp_rank: rank,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_display_round_trip() {
        for s in ["10.0.0.1:8000", "10.0.0.1:8000#3", "[::1]:9000#1"] {
            assert_eq!(s.parse::<WorkerId>().unwrap().to_string(), s);
        }
        assert!("10.0.0.1".parse::<WorkerId>().is_err());
        assert!("10.0.0.1:80#x".parse::<WorkerId>().is_err());
    }
}
