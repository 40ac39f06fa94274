//! Fuzz target: the config parser and validator never panic, whatever the
//! bytes, and the reload path that reuses unchanged tables (`Loader`)
//! always reaches the full read's verdict. Non-UTF-8 input goes through the
//! same check `config::load` does.
//!
//! Run (from the repository root):
//! `RUSTC_BOOTSTRAP=1 cargo fuzz run config_parse --fuzz-dir tests/fuzz -- -max_total_time=60`

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let full = harvester_lb::config::parse(text);
        let piecewise = harvester_lb::config::Loader::new().parse(text);
        assert_eq!(
            piecewise.as_ref().map(|l| (&l.config, &l.warnings)),
            full.as_ref().map(|l| (&l.config, &l.warnings)),
        );
        match full {
            Ok(loaded) => {
                // A valid config must be internally consistent.
                let names: std::collections::HashSet<_> =
                    loaded.config.load_balancers.iter().map(|l| &l.name).collect();
                assert_eq!(names.len(), loaded.config.load_balancers.len());
                for lb in &loaded.config.load_balancers {
                    if let Some(hc) = &lb.health_check {
                        assert!(hc.timeout <= hc.period);
                    }
                }
            }
            Err(problems) => assert!(!problems.is_empty()),
        }
    }
});
