//! What the load groups count: CPU seconds from `/proc` (a process, or this process's threads
//! by name) and the commands a Redis has run.

use anyhow::{Context, Result};
use idemgate_sidecar::testing::RedisServer;
use std::path::{Path, PathBuf};

/// CPU seconds (user + system) in `/proc/<path>/stat` (`self`, a pid, `self/task/<tid>`),
/// with the name of the process or thread.
pub fn cpu_of(path: &Path) -> Option<(String, f64)> {
    cpu_split_of(path).map(|(name, split)| (name, split.total()))
}

/// CPU seconds in user space and in the kernel.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct UserSystem {
    pub user: f64,
    pub system: f64,
}

impl UserSystem {
    pub fn total(&self) -> f64 {
        self.user + self.system
    }
}

/// [`cpu_of`], user and kernel time apart. The kernel splits a thread's run time between the
/// two by sampling, so the split of a short run is an estimate where the total is not.
pub fn cpu_split_of(path: &Path) -> Option<(String, UserSystem)> {
    let stat = std::fs::read_to_string(path.join("stat")).ok()?;
    // Fields 14 and 15 in clock ticks of 1/100 s; the name in field 2 may hold spaces, so
    // count from the closing parenthesis.
    let (head, rest) = stat.rsplit_once(')')?;
    let name = head.split_once('(')?.1.to_owned();
    let mut fields = rest.split_whitespace().skip(11);
    let user: f64 = fields.next()?.parse().ok()?;
    let system: f64 = fields.next()?.parse().ok()?;
    Some((
        name,
        UserSystem {
            user: user / 100.0,
            system: system / 100.0,
        },
    ))
}

/// CPU seconds of this process's threads whose names start with `prefix`.
pub fn threads_cpu(prefix: &str) -> f64 {
    threads_cpu_split(prefix).total()
}

/// [`threads_cpu`], user and kernel time apart.
pub fn threads_cpu_split(prefix: &str) -> UserSystem {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return UserSystem::default();
    };
    tasks
        .filter_map(|task| cpu_split_of(&task.ok()?.path()))
        .filter(|(name, _)| name.starts_with(prefix))
        .fold(UserSystem::default(), |sum, (_, split)| UserSystem {
            user: sum.user + split.user,
            system: sum.system + split.system,
        })
}

/// CPU seconds of process `pid`.
pub fn pid_cpu(pid: u32) -> Result<f64> {
    cpu_of(&PathBuf::from(format!("/proc/{pid}")))
        .map(|(_, s)| s)
        .with_context(|| format!("reading /proc/{pid}/stat"))
}

/// Commands `redis` has run so far (`INFO commandstats`, each call inside a script counted),
/// less the `INFO` calls that read it.
pub fn redis_commands(redis: &RedisServer) -> Result<f64> {
    let stats = redis.cli(&["INFO", "commandstats"])?;
    Ok(stats
        .lines()
        .filter(|l| l.starts_with("cmdstat_") && !l.starts_with("cmdstat_info:"))
        .filter_map(|l| {
            l.split_once("calls=")?
                .1
                .split(',')
                .next()?
                .parse::<f64>()
                .ok()
        })
        .sum())
}
