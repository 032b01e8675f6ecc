//! Times each phase of one large derivation (a development aid):
//! `cargo run --release -p mpipe-core --example phases -- PROFILE`.
use mpipe_core::analysis::{dependencies, timing};
use mpipe_core::generators::{generate, BodyKind};
use mpipe_core::lower::{lower_with, Placement};
use mpipe_core::operators::transpose::{transpose, Backward, Owners};
use mpipe_core::profile::Profile;
use mpipe_core::simulate::{simulate, SimOptions};
use mpipe_core::verify::verify;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: phases PROFILE")?;
    let prof = Profile::from_toml_str(&std::fs::read_to_string(path)?)?;
    let t = Instant::now();
    let plan = generate(BodyKind::ZbV, &prof, 64, 1024)?;
    println!("generate zbv 64x1024: {:?}", t.elapsed());
    let t = Instant::now();
    let _ = transpose(plan.clone(), 0, Owners::RoundRobin, Backward::Local)?;
    println!("transpose: {:?}", t.elapsed());
    let t = Instant::now();
    let d = dependencies(&plan)?;
    println!("dependencies: {:?}", t.elapsed());
    let t = Instant::now();
    let _ = timing(&plan, &d)?;
    println!("ideal timing: {:?}", t.elapsed());
    for pl in [Placement::Meet, Placement::Ready] {
        let t = Instant::now();
        let prog = lower_with(&plan, None, pl)?;
        println!("lower {pl:?}: {:?}", t.elapsed());
        let t = Instant::now();
        let _ = simulate(&prog, &SimOptions::default())?;
        println!("simulate: {:?}", t.elapsed());
        let t = Instant::now();
        let _ = verify(&prog);
        println!("verify: {:?}", t.elapsed());
    }
    let req = mpipe_core::derive::Request::new(&prof, 64, 1024);
    for e in ["zbv", "transpose(vision, zbv)", "1f1b"] {
        let t = Instant::now();
        let d = mpipe_core::derive::derive_str(&req, e).map_err(|e| format!("{e:?}"))?;
        println!(
            "derive+verify+simulate {e}: {:?} (makespan {})",
            t.elapsed(),
            d.report.makespan
        );
    }
    Ok(())
}
