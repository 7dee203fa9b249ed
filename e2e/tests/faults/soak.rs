//! The soak run (`cargo xtask soak`, ignored in `cargo xtask test`): moderate mixed load
//! through two gateways for a bounded time, Redis restarted (empty) every few minutes.
//! Reports executions against unique keys, the process's and Redis's memory over time and
//! locks left after one lease; the summary goes to stdout and `target/soak.md`.

use crate::rig::*;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const RULES: &str = r#"[
 {"name":"payments","match":{"path_prefix":"/payments"},"lease":"5s"},
 {"name":"tools","mode":"lock","match":{"path_template":"/agents/{agent}/tools"},"key":{"path_param":"agent"},"lease":"5s","on_conflict":"queue","queue":{"max_wait":"10s"}}]"#;

/// `IDEMGATE_SOAK_SECS` (default 600).
fn duration() -> Duration {
    let secs = std::env::var("IDEMGATE_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(600);
    Duration::from_secs(secs)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn redis_memory(rig: &Rig) -> u64 {
    rig.redis()
        .cli(&["info", "memory"])
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("used_memory:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

#[test]
#[ignore = "long: run with `cargo xtask soak`"]
fn soak() {
    let total = duration();
    let restart_every = (total / 3).max(Duration::from_secs(20));
    let mut rig = Rig::start(Options {
        rules: RULES,
        ..Options::default()
    });
    let second = rig.second_gateway(RULES);
    let gateways = [rig.addr, second.addr()];
    let stop = Arc::new(AtomicBool::new(false));
    let payment_keys = Arc::new(AtomicU64::new(0));
    let answers = Arc::new(AtomicU64::new(0));
    let slow_answers = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    // Payments: each key sent twice to each gateway at once.
    for worker in 0..2u64 {
        let (stop, keys, answers, slow) = (
            Arc::clone(&stop),
            Arc::clone(&payment_keys),
            Arc::clone(&answers),
            Arc::clone(&slow_answers),
        );
        workers.push(std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("soak-{worker}-{n}");
                n += 1;
                keys.fetch_add(1, Ordering::Relaxed);
                let calls: Vec<_> = gateways
                    .iter()
                    .flat_map(|g| [*g, *g])
                    .map(|g| {
                        let key = key.clone();
                        std::thread::spawn(move || pay(g, &key, 20))
                    })
                    .collect();
                for call in calls {
                    let call = call.join().unwrap();
                    answers.fetch_add(1, Ordering::Relaxed);
                    if call.took >= ANSWER_BOUND || call.status() == 0 {
                        slow.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    // Tool attaches: 4 agents, both gateways, queued.
    for agent in 0..4u64 {
        let (stop, answers, slow) = (
            Arc::clone(&stop),
            Arc::clone(&answers),
            Arc::clone(&slow_answers),
        );
        workers.push(std::thread::spawn(move || {
            let mut n = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let call = send(
                    gateways[n % 2],
                    "POST",
                    &format!("/agents/soak-{agent}/tools"),
                    &[
                        ("content-type", "application/json"),
                        ("x-demo-work-ms", "20"),
                    ],
                    &format!(r#"{{"tool":"t{n}"}}"#),
                );
                n += 1;
                answers.fetch_add(1, Ordering::Relaxed);
                if call.took >= ANSWER_BOUND || call.status() == 0 {
                    slow.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }

    let started = Instant::now();
    let mut samples = Vec::new();
    let mut restarts = 0;
    let mut next_restart = restart_every;
    while started.elapsed() < total {
        std::thread::sleep(Duration::from_secs(5).min(total.saturating_sub(started.elapsed())));
        samples.push((started.elapsed().as_secs(), rss_kib(), redis_memory(&rig)));
        if started.elapsed() >= next_restart && started.elapsed() + Duration::from_secs(10) < total
        {
            rig.redis_mut().restart().expect("redis restarts");
            restarts += 1;
            next_restart += restart_every;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    let stats = rig.stats();
    let keys = payment_keys.load(Ordering::Relaxed);
    let mut report = String::new();
    let _ = writeln!(
        report,
        "soak: {}s, {restarts} Redis restarts, 2 gateways\n",
        total.as_secs()
    );
    let _ = writeln!(report, "| what | value |\n|---|---|");
    for (what, value) in [
        ("client answers", answers.load(Ordering::Relaxed)),
        (
            "answers past the bound or without a status",
            slow_answers.load(Ordering::Relaxed),
        ),
        ("unique payment keys", keys),
        ("payments executed", stats.charges),
        ("double charges", stats.double_charges),
        ("tool attaches", stats.tool_attaches),
        ("lost updates", stats.lost_updates),
        ("max overlap on one resource", u64::from(stats.max_overlap)),
        ("stale writes refused", stats.stale_refused),
    ] {
        let _ = writeln!(report, "| {what} | {value} |");
    }
    let _ = writeln!(
        report,
        "\n| t (s) | test process RSS (KiB) | Redis used_memory (B) |\n|---|---|---|"
    );
    for (t, rss, redis) in &samples {
        let _ = writeln!(report, "| {t} | {rss} | {redis} |");
    }
    second.shutdown();
    // Every lock ends within one lease (5 s) after the load stops.
    rig.assert_no_lock_held_after(Duration::from_secs(5));
    let _ = writeln!(report, "\nlocks held one lease after the load: 0");
    println!("{report}");
    let out = idemgate_host::target_dir().join("soak.md");
    std::fs::write(&out, &report).expect("write target/soak.md");
    assert_eq!(slow_answers.load(Ordering::Relaxed), 0, "{report}");
    assert_eq!(stats.double_charges, 0, "{report}");
    assert_eq!(stats.lost_updates, 0, "{report}");
}
