//! The rendezvous of a job's processes: rank 0 hands a few bytes (NCCL's unique id) to every other rank over TCP at
//! `MASTER_ADDR:MASTER_PORT`, as torch's TCPStore does for `init_process_group`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::env::WorldEnv;
use crate::error::{Error, Result};

/// What a rank sends first: the protocol's name and version.
const HELLO: &[u8; 11] = b"QLORA-RDZV1";

/// Gives every rank of `env`'s job the bytes rank 0 passes as `payload` (the other ranks pass `None`). Rank 0
/// listens at `MASTER_PORT` until every other rank has connected and been answered; the others connect to
/// `MASTER_ADDR:MASTER_PORT`, retrying while rank 0 starts. Each waits at most `timeout`, then fails naming the
/// ranks that did not arrive, or the address that did not answer.
pub fn share_from_rank0(
    env: &WorldEnv,
    payload: Option<&[u8]>,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    match (env.is_main(), payload) {
        (true, Some(payload)) => serve(env, payload, deadline, timeout).map(|()| payload.to_vec()),
        (false, None) => fetch(env, deadline, timeout),
        _ => Err(Error::InvalidInput(
            "share_from_rank0: rank 0, and only rank 0, passes the payload".into(),
        )),
    }
}

fn rendezvous_error(what: String) -> Error {
    Error::InvalidInput(format!("distributed rendezvous: {what}"))
}

fn serve(env: &WorldEnv, payload: &[u8], deadline: Instant, timeout: Duration) -> Result<()> {
    let listener = TcpListener::bind(("0.0.0.0", env.master_port)).map_err(|e| {
        rendezvous_error(format!(
            "rank 0 cannot listen on port {} (MASTER_PORT): {e}; another job may hold it: choose another MASTER_PORT",
            env.master_port
        ))
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| rendezvous_error(format!("port {}: {e}", env.master_port)))?;
    let mut answered = vec![false; env.world_size];
    answered[0] = true;
    while answered.iter().any(|a| !a) {
        match listener.accept() {
            Ok((stream, peer)) => {
                // A stray connection (a port scanner, a rank of another job) is answered and ignored.
                if let Ok(rank) = answer(stream, env, payload, deadline) {
                    answered[rank] = true;
                } else {
                    eprintln!("distributed rendezvous: ignored a connection from {peer} that is not a rank of this job");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> =
                        (0..env.world_size).filter(|r| !answered[*r]).collect();
                    return Err(rendezvous_error(format!(
                        "ranks {missing:?} of {} did not connect to rank 0 (port {}) within {} s: did they start, \
                         with MASTER_ADDR/MASTER_PORT pointing at rank 0's host?",
                        env.world_size,
                        env.master_port,
                        timeout.as_secs_f64()
                    )));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                return Err(rendezvous_error(format!(
                    "accepting on port {}: {e}",
                    env.master_port
                )))
            }
        }
    }
    Ok(())
}

/// Reads a rank's hello and sends it the payload; the rank, when the hello is one of this job's.
fn answer(
    mut stream: TcpStream,
    env: &WorldEnv,
    payload: &[u8],
    deadline: Instant,
) -> std::io::Result<usize> {
    let wait = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(100));
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(wait))?;
    let mut hello = [0u8; 19];
    stream.read_exact(&mut hello)?;
    let rank = u32::from_le_bytes(hello[11..15].try_into().unwrap()) as usize;
    let world = u32::from_le_bytes(hello[15..19].try_into().unwrap()) as usize;
    let reply = if &hello[..11] != HELLO {
        return Err(std::io::Error::other("not a rendezvous hello"));
    } else if world != env.world_size || rank == 0 || rank >= world {
        Err(format!(
            "rank {rank} of {world} asked, but rank 0 leads a job of {} ranks",
            env.world_size
        ))
    } else {
        Ok(payload)
    };
    match reply {
        Ok(bytes) => {
            stream.write_all(&[0])?;
            stream.write_all(&(bytes.len() as u32).to_le_bytes())?;
            stream.write_all(bytes)?;
            Ok(rank)
        }
        Err(message) => {
            stream.write_all(&[1])?;
            stream.write_all(&(message.len() as u32).to_le_bytes())?;
            stream.write_all(message.as_bytes())?;
            Err(std::io::Error::other(message))
        }
    }
}

fn fetch(env: &WorldEnv, deadline: Instant, timeout: Duration) -> Result<Vec<u8>> {
    let master = env.master();
    let no_answer = |why: String| {
        rendezvous_error(format!(
            "rank {}: no rendezvous at {master} within {} s ({why}): is rank 0 running, and do MASTER_ADDR and \
             MASTER_PORT point at it?",
            env.rank,
            timeout.as_secs_f64()
        ))
    };
    let mut last = String::from("no answer");
    loop {
        if Instant::now() >= deadline {
            return Err(no_answer(last));
        }
        let addrs = match master.to_socket_addrs() {
            Ok(a) => a.collect::<Vec<_>>(),
            Err(e) => {
                last = format!("cannot resolve MASTER_ADDR: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        for addr in addrs {
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(10));
            match TcpStream::connect_timeout(&addr, wait.min(Duration::from_secs(5))) {
                Ok(stream) => match exchange(stream, env, wait) {
                    Ok(Ok(bytes)) => return Ok(bytes),
                    Ok(Err(refusal)) => {
                        return Err(rendezvous_error(format!("rank {}: {refusal}", env.rank)))
                    }
                    Err(e) => last = e.to_string(),
                },
                Err(e) => last = e.to_string(),
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends the hello and reads rank 0's reply: the payload, or why rank 0 refused this rank.
fn exchange(
    mut stream: TcpStream,
    env: &WorldEnv,
    wait: Duration,
) -> std::io::Result<std::result::Result<Vec<u8>, String>> {
    stream.set_read_timeout(Some(wait))?;
    let mut hello = HELLO.to_vec();
    hello.extend_from_slice(&(env.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(env.world_size as u32).to_le_bytes());
    stream.write_all(&hello)?;
    let mut head = [0u8; 5];
    stream.read_exact(&mut head)?;
    let len = u32::from_le_bytes(head[1..5].try_into().unwrap()) as usize;
    if len > 1 << 20 {
        return Err(std::io::Error::other("the reply is not a rendezvous reply"));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    Ok(if head[0] == 0 {
        Ok(body)
    } else {
        Err(String::from_utf8_lossy(&body).into_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn env(rank: usize, world_size: usize, port: u16) -> WorldEnv {
        WorldEnv {
            rank,
            world_size,
            local_rank: rank,
            local_world_size: world_size,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        }
    }

    #[test]
    fn every_rank_gets_rank_zeros_bytes() {
        let port = free_port();
        let id: Vec<u8> = (0..128u8).collect();
        // The other ranks start first: they retry until rank 0 listens.
        let others: Vec<_> = (1..4)
            .map(|r| {
                std::thread::spawn(move || {
                    share_from_rank0(&env(r, 4, port), None, Duration::from_secs(20))
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let mine = share_from_rank0(&env(0, 4, port), Some(&id), Duration::from_secs(20)).unwrap();
        assert_eq!(mine, id);
        for t in others {
            assert_eq!(t.join().unwrap().unwrap(), id);
        }
    }

    #[test]
    fn ranks_that_do_not_arrive_are_named() {
        let port = free_port();
        let late = std::thread::spawn(move || {
            share_from_rank0(&env(2, 3, port), None, Duration::from_secs(10))
        });
        let err =
            share_from_rank0(&env(0, 3, port), Some(b"id"), Duration::from_secs(3)).unwrap_err();
        assert!(
            err.to_string().contains("ranks [1] of 3 did not connect"),
            "{err}"
        );
        assert_eq!(late.join().unwrap().unwrap(), b"id");
        let err = share_from_rank0(&env(1, 3, free_port()), None, Duration::from_millis(300))
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("rank 1: no rendezvous at 127.0.0.1:"),
            "{err}"
        );
    }

    #[test]
    fn a_rank_of_another_job_size_is_refused() {
        // The ranks take turns (the stray one is refused before rank 1 of the job connects), so a loaded machine
        // cannot reorder them; rank 0's deadline only has to outlast the two connections.
        // A port found free can be taken (by another test's connection) before rank 0 listens on it: then rank 0
        // says so at once and the scenario runs again on another port.
        let mut attempts = 0;
        let (port, leader) = loop {
            attempts += 1;
            assert!(attempts <= 5, "no free port for rank 0 in 5 attempts");
            let port = free_port();
            let leader = std::thread::spawn(move || {
                share_from_rank0(&env(0, 4, port), Some(b"id"), Duration::from_secs(6))
            });
            let refused = share_from_rank0(&env(1, 2, port), None, Duration::from_secs(10))
                .unwrap_err()
                .to_string();
            if refused.contains("rank 1 of 2 asked, but rank 0 leads a job of 4 ranks") {
                break (port, leader);
            }
            let listening = leader.join().unwrap().unwrap_err().to_string();
            assert!(
                listening.contains("rank 0 cannot listen on port"),
                "{refused} / {listening}"
            );
        };
        let id = share_from_rank0(&env(1, 4, port), None, Duration::from_secs(10)).unwrap();
        assert_eq!(id, b"id");
        let err = leader.join().unwrap().unwrap_err();
        assert!(err.to_string().contains("ranks [2, 3] of 4"), "{err}");
    }
}
