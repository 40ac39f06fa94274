//! What a process tree costs, read from `/proc`: resident memory and CPU
//! time of a pid and its descendants (nginx's workers are children of its
//! master). Bounded to 64 processes per walk.

/// Resident memory of `pid` and its children, bytes.
pub fn rss_tree(pid: i32) -> u64 {
    tree(pid)
        .into_iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter_map(|line| line.strip_prefix("VmRSS:"))
                .map(|v| {
                    v.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .unwrap_or(0)
                        * 1024
                })
                .collect::<Vec<_>>()
        })
        .sum()
}

/// CPU time (user + system) of `pid` and its children, seconds.
pub fn cpu_seconds_tree(pid: i32) -> f64 {
    let mut ticks = 0u64;
    for p in tree(pid) {
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) {
            // Fields after the command name (which may hold spaces): state is field 3.
            if let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) {
                let f: Vec<&str> = rest.split_whitespace().collect();
                // utime is field 14, stime 15 (1-based over the whole line).
                ticks += f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
                ticks += f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            }
        }
    }
    #[allow(unsafe_code)]
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ticks as f64 / hz
}

/// `pid` and its descendants, at most 64.
fn tree(pid: i32) -> Vec<i32> {
    let mut found = Vec::new();
    let mut stack = vec![pid];
    while let Some(p) = stack.pop() {
        if found.len() == 64 {
            break;
        }
        found.push(p);
        stack.extend(children(p));
    }
    found
}

/// The children of `pid`'s main thread (where nginx's master forks its
/// workers and every other proxy has none).
fn children(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .map(|c| {
            c.split_whitespace()
                .filter_map(|c| c.parse::<i32>().ok())
                .collect()
        })
        .unwrap_or_default()
}
