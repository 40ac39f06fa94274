//! What the health and scale scenarios probe and how probes are seen:
//! targets that listen on loopback addresses, and a tcpdump capture of the
//! SYNs sent to them.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::targets::Proc;
use crate::util::{bench_listener, sa, signal};

/// Listens on every target address. Both probers check the way HAProxy
/// does (SYN, SYN-ACK, reset: the target never accepts), so a probe is seen
/// by capturing SYNs (see [`SynCapture`]), not by accepting; the accept loop
/// only keeps the queues empty for a prober that completes handshakes.
pub struct ProbeTargets {
    rt: Option<tokio::runtime::Runtime>,
}

impl ProbeTargets {
    /// One listener per target, on `ip(i)`.
    pub fn start(n: usize, ip: impl Fn(usize) -> Ipv4Addr, port: u16) -> ProbeTargets {
        let t = ProbeTargets::empty();
        for i in 0..n {
            let addr = sa(ip(i), port);
            let std_l = std::net::TcpListener::bind(addr)
                .unwrap_or_else(|e| panic!("bind probe target {addr}: {e}"));
            std_l.set_nonblocking(true).expect("nonblocking");
            t.serve(std_l);
        }
        t
    }

    /// One listener on `0.0.0.0:port`, tied to `lo`: every loopback address is
    /// a target. The scale scenario's 30,000 targets would not fit the
    /// open-file limit as listeners of their own.
    pub fn loopback(port: u16) -> ProbeTargets {
        let t = ProbeTargets::empty();
        t.serve(bench_listener(sa(Ipv4Addr::UNSPECIFIED, port)));
        t
    }

    fn empty() -> ProbeTargets {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        ProbeTargets { rt: Some(rt) }
    }

    /// Accepts and drops on `std_l` (non-blocking) until dropped.
    fn serve(&self, std_l: std::net::TcpListener) {
        let rt = self.rt.as_ref().expect("runtime");
        rt.spawn(async move {
            let l = tokio::net::TcpListener::from_std(std_l).expect("tokio listener");
            loop {
                match l.accept().await {
                    Ok((s, _)) => drop(s),
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
        });
    }
}

impl Drop for ProbeTargets {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// `tcpdump` on the loopback interface recording when each target receives
/// a SYN (seconds, kernel timestamps). Runs only in its own window: the
/// capture's per-packet cost lands on the sending process, so the CPU
/// window runs without it. Targets are the SYNs to `port` in `net`; `index`
/// numbers them (0..n; None: not a target).
pub struct SynCapture {
    proc: Proc,
    arrivals: Arc<Mutex<Vec<Vec<f64>>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl SynCapture {
    pub fn start(
        n: usize,
        work: &Path,
        port: u16,
        net: &str,
        index: impl Fn(Ipv4Addr) -> Option<usize> + Send + 'static,
    ) -> SynCapture {
        let log = work.join("tcpdump.log");
        let filter = format!(
            "dst port {port} and dst net {net} and tcp[tcpflags] & (tcp-syn|tcp-ack) == tcp-syn"
        );
        let mut cmd = Command::new("tcpdump");
        cmd.args([
            "-i",
            "lo",
            "-n",
            "-tt",
            "-q",
            "-l",
            "--immediate-mode",
            "-B",
            "16384",
            "-s",
            "96",
        ])
        .arg(&filter);
        let out = std::fs::File::create(&log).expect("create log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start tcpdump: {e}"));
        let mut proc = Proc {
            name: "tcpdump".into(),
            child,
        };
        let stdout = proc.child.stdout.take().expect("tcpdump stdout");
        let arrivals = Arc::new(Mutex::new(vec![Vec::new(); n]));
        let sink = Arc::clone(&arrivals);
        let reader = std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // "1795335728.251234 IP 127.0.0.1.40000 > 127.250.3.17.30999: tcp 0"
                let mut f = line.split_whitespace();
                let (Some(ts), Some(dst)) = (f.next(), f.nth(3)) else {
                    continue;
                };
                let (Ok(ts), Some((ip, _port))) = (
                    ts.parse::<f64>(),
                    dst.trim_end_matches(':').rsplit_once('.'),
                ) else {
                    continue;
                };
                let Some(i) = ip.parse::<Ipv4Addr>().ok().and_then(&index) else {
                    continue;
                };
                let mut a = sink.lock().unwrap_or_else(|p| p.into_inner());
                if i < a.len() && a[i].len() < 10_000 {
                    a[i].push(ts);
                }
            }
        });
        // tcpdump says "listening on lo" once the capture is in place.
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline
            && !std::fs::read_to_string(&log).is_ok_and(|l| l.contains("listening on"))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        SynCapture {
            proc,
            arrivals,
            reader: Some(reader),
        }
    }

    /// Stops the capture; the SYN times of each target, in order.
    pub fn finish(mut self) -> Vec<Vec<f64>> {
        signal(self.proc.pid(), libc::SIGINT);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let mut a = self.arrivals.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut *a)
    }
}
