//! Times each stage of `auto`'s search (a development aid):
//! `cargo run --release -p mpipe-core --example auto_stages -- PROFILE RANKS MICROBATCHES [THREADS]`.
use mpipe_core::profile::Profile;
use mpipe_core::progress::{with_progress, Progress};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

struct Log {
    start: Instant,
    open: Mutex<BTreeMap<u64, (String, u64, u64, Instant)>>,
}

impl Progress for Log {
    fn begin(&self, id: u64, what: &str, total: u64) {
        self.open
            .lock()
            .unwrap()
            .insert(id, (what.to_string(), total, 0, Instant::now()));
    }
    fn advance(&self, id: u64, n: u64) {
        if let Some(o) = self.open.lock().unwrap().get_mut(&id) {
            o.2 += n;
        }
    }
    fn end(&self, id: u64) {
        if let Some((what, total, done, began)) = self.open.lock().unwrap().remove(&id) {
            eprintln!(
                "{:8.3}s  {:8.3}s  {done}/{total}  {what}",
                self.start.elapsed().as_secs_f64(),
                began.elapsed().as_secs_f64()
            );
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let prof = Profile::from_toml_str(&std::fs::read_to_string(&args[1])?)?;
    let (p, m): (usize, usize) = (args[2].parse()?, args[3].parse()?);
    let mut req = mpipe_core::derive::Request::new(&prof, p, m);
    if let Some(t) = args.get(4) {
        req.policy.max_threads = t.parse()?;
    }
    let log = Arc::new(Log {
        start: Instant::now(),
        open: Mutex::new(BTreeMap::new()),
    });
    let d = with_progress(log, || mpipe_core::derive::derive_str(&req, "auto"))
        .map_err(|e| format!("{e:?}"))?;
    println!("{} {}", d.expr, d.report.makespan);
    Ok(())
}
