//! Where a process stands in a distributed job, from the environment torchrun (and `torch.distributed.launch`,
//! `accelerate launch`, Slurm scripts that export the same) gives each process.

use crate::error::{Error, Result};

/// One process's place in a distributed job (torchrun's variables).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorldEnv {
    /// `RANK`: this process among all, 0-based.
    pub rank: usize,
    /// `WORLD_SIZE`: processes in the job.
    pub world_size: usize,
    /// `LOCAL_RANK`: this process among those of its node; its GPU ordinal.
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE`: processes on this node (the world size when unset).
    pub local_world_size: usize,
    /// `MASTER_ADDR`: the host of rank 0, where the rendezvous listens.
    pub master_addr: String,
    /// `MASTER_PORT`: the rendezvous's port.
    pub master_port: u16,
}

impl WorldEnv {
    /// The job this process belongs to, from its environment; `None` when `WORLD_SIZE` is unset (a single process).
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// [`WorldEnv::from_env`] over any source of variables (`lookup(name)` is the value, if set).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let Some(world) = lookup("WORLD_SIZE") else {
            return Ok(None);
        };
        let number = |name: &str, value: &str| -> Result<usize> {
            value.trim().parse().map_err(|_| {
                Error::InvalidInput(format!(
                    "environment variable {name}={value:?} is not a non-negative integer (torchrun sets it; a \
                     launcher of your own must too)"
                ))
            })
        };
        let required = |name: &str| -> Result<String> {
            lookup(name).ok_or_else(|| {
                Error::InvalidInput(format!(
                    "WORLD_SIZE={world} is set but {name} is not: a distributed process needs RANK, WORLD_SIZE, \
                     LOCAL_RANK, MASTER_ADDR and MASTER_PORT, as torchrun sets them"
                ))
            })
        };
        let world_size = number("WORLD_SIZE", &world)?;
        if world_size == 0 {
            return Err(Error::InvalidInput(
                "environment variable WORLD_SIZE=0: a job has at least one process".into(),
            ));
        }
        let rank = number("RANK", &required("RANK")?)?;
        let local_rank = match lookup("LOCAL_RANK") {
            Some(v) => number("LOCAL_RANK", &v)?,
            None if world_size == 1 => 0,
            None => {
                return Err(Error::InvalidInput(
                    required("LOCAL_RANK").unwrap_err().to_string(),
                ))
            }
        };
        let local_world_size = match lookup("LOCAL_WORLD_SIZE") {
            Some(v) => number("LOCAL_WORLD_SIZE", &v)?,
            None => world_size,
        };
        if rank >= world_size || local_rank >= local_world_size || local_world_size > world_size {
            return Err(Error::InvalidInput(format!(
                "RANK={rank} LOCAL_RANK={local_rank} do not fit WORLD_SIZE={world_size} \
                 LOCAL_WORLD_SIZE={local_world_size}: ranks count from 0 below the sizes"
            )));
        }
        let (master_addr, master_port) = if world_size == 1 {
            let addr = lookup("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
            let port = lookup("MASTER_PORT").map_or(Ok(29500), |p| number("MASTER_PORT", &p))?;
            (addr, port)
        } else {
            (
                required("MASTER_ADDR")?,
                number("MASTER_PORT", &required("MASTER_PORT")?)?,
            )
        };
        let master_port = u16::try_from(master_port).map_err(|_| {
            Error::InvalidInput(format!(
                "environment variable MASTER_PORT={master_port} is not a port (0–65535)"
            ))
        })?;
        Ok(Some(WorldEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
        }))
    }

    /// Whether this process is rank 0, the one that writes logs, checkpoints and the adapter.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    /// The rendezvous address, `MASTER_ADDR:MASTER_PORT`.
    pub fn master(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port) // an IPv6 literal
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<Option<WorldEnv>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        WorldEnv::from_lookup(|name| map.get(name).cloned())
    }

    #[test]
    fn torchrun_variables_give_the_place_in_the_job() {
        assert_eq!(parse(&[]).unwrap(), None);
        let env = parse(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                env.rank,
                env.world_size,
                env.local_rank,
                env.local_world_size
            ),
            (5, 8, 1, 4)
        );
        assert_eq!(env.master(), "node0:29500");
        assert!(!env.is_main());
        let single = parse(&[("WORLD_SIZE", "1"), ("RANK", "0")])
            .unwrap()
            .unwrap();
        assert!(single.is_main() && single.local_rank == 0 && single.master_port == 29500);
        let v6 = parse(&[("WORLD_SIZE", "1"), ("RANK", "0"), ("MASTER_ADDR", "::1")])
            .unwrap()
            .unwrap();
        assert_eq!(v6.master(), "[::1]:29500");
    }

    #[test]
    fn a_missing_or_bad_variable_is_named() {
        let base = [
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ];
        let without = |name: &str| -> Vec<(&str, &str)> {
            base.iter().copied().filter(|(k, _)| *k != name).collect()
        };
        for name in ["RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] {
            let err = parse(&without(name)).unwrap_err().to_string();
            assert!(err.contains(&format!("{name} is not")), "{name}: {err}");
        }
        let mut bad = base.to_vec();
        bad[0] = ("RANK", "one");
        assert!(parse(&bad)
            .unwrap_err()
            .to_string()
            .contains("RANK=\"one\""));
        bad[0] = ("RANK", "2");
        assert!(parse(&bad).unwrap_err().to_string().contains("RANK=2"));
        bad[0] = ("RANK", "1");
        bad[4] = ("MASTER_PORT", "70000");
        assert!(parse(&bad)
            .unwrap_err()
            .to_string()
            .contains("MASTER_PORT=70000"));
        assert!(parse(&[("WORLD_SIZE", "0")])
            .unwrap_err()
            .to_string()
            .contains("WORLD_SIZE=0"));
    }
}
