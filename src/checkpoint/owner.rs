//! Who wrote a file or holds a directory: this host, this process, and this run.
//!
//! Every temporary entry, completion marker and lock a run writes records its [`Owner`],
//! so that clean-up removes only what a run of this project created, and a second run on
//! the same directory can name the holder ("held by pid 4242 on node7 since ...").
//! `run_id` is random per launch: a pid can be reused after a reboot or on another host of
//! a shared file system, a run id cannot.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use rand::Rng;
use serde::{Deserialize, Serialize};

/// The writer of an entry: host, process and run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// `/proc/sys/kernel/hostname` of the writing host.
    pub host: String,
    pub pid: u32,
    /// 16 hex digits, random per launch.
    pub run_id: String,
    /// Seconds since the Unix epoch when this process started its run.
    pub started: u64,
}

impl Owner {
    /// This process's owner record (the same value for the whole process).
    pub fn this_run() -> &'static Owner {
        static OWNER: OnceLock<Owner> = OnceLock::new();
        OWNER.get_or_init(|| Owner {
            host: host_name(),
            pid: std::process::id(),
            run_id: format!("{:016x}", rand::rng().random::<u64>()),
            started: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        })
    }

    /// Whether the owner is this process's run.
    pub fn is_this_run(&self) -> bool {
        self == Owner::this_run()
    }

    /// Whether the owner ran on this host.
    pub fn on_this_host(&self) -> bool {
        self.host == Owner::this_run().host
    }

    /// Whether the owner process is known to be gone: it ran on this host and no process
    /// of its pid exists, or one does that started after it (a reused pid). An owner on
    /// another host is never known to be gone.
    pub fn is_dead(&self) -> bool {
        if !self.on_this_host() {
            return false;
        }
        match process_start(self.pid) {
            None => true,
            Some(started) => started > self.started + 1,
        }
    }

    /// "pid 4242 on node7 (run 1f..., started 2026-11-28 08:12:20 UTC)".
    pub fn describe(&self) -> String {
        format!(
            "pid {} on {} (run {}, started {})",
            self.pid,
            self.host,
            self.run_id,
            utc(self.started)
        )
    }
}

/// The host name, or `unknown-host`.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown-host".into())
}

/// When process `pid` of this host started (seconds since the epoch), if it exists.
fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22 (starttime, clock ticks after boot) follows the command in parentheses,
    // which may itself hold spaces and parentheses.
    let after = &stat[stat.rfind(')')? + 2..];
    let ticks: u64 = after.split_whitespace().nth(19)?.parse().ok()?;
    // /proc counts in USER_HZ, which Linux fixes at 100 on every architecture we run on.
    let hz = 100;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).ok()?.as_secs();
    let boot = now.saturating_sub(uptime as u64);
    Some(boot + ticks / hz)
}

/// `secs` since the epoch as `YYYY-MM-DD HH:MM:SS UTC`.
pub fn utc(secs: u64) -> String {
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_a_missing_one_is_dead() {
        let me = Owner::this_run();
        assert!(me.is_this_run());
        assert!(!me.is_dead(), "this process is running");
        let started = process_start(me.pid).expect("this process has a /proc entry");
        assert!(
            started <= me.started + 1,
            "started {started} vs {}",
            me.started
        );
        // pid_max is at most 2^22 on Linux: this pid cannot exist.
        let gone = Owner {
            pid: 1 << 23,
            ..me.clone()
        };
        assert!(gone.is_dead());
        // A reused pid: the process there started after the owner did.
        let reused = Owner {
            started: 0,
            ..me.clone()
        };
        assert!(reused.is_dead());
        let elsewhere = Owner {
            host: format!("{}-elsewhere", me.host),
            pid: 1 << 23,
            ..me.clone()
        };
        assert!(
            !elsewhere.is_dead(),
            "another host's process is never known gone"
        );
    }

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        // date -u -d @1795853540
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(1_795_853_540), "2026-11-28 08:12:20 UTC");
    }
}
