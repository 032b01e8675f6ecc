//! Helpers shared by the tests: driving the units by hand.
#![allow(dead_code)]

use mpipe_mllm::{Float, Mllm, Stash};

/// Forward of units `from ..` on micro-batch `mb`, starting from `input` (the
/// output of unit `from - 1`, or nothing for the encoder). Returns the loss.
pub(crate) fn forward_from<F: Float>(
    model: &mut Mllm<F>,
    mb: usize,
    from: usize,
    input: Option<Vec<F>>,
) -> F {
    let mut act = input;
    for u in from..model.units() {
        let inputs: Vec<&[F]> = act.iter().map(Vec::as_slice).collect();
        act = Some(model.forward_unit(u, mb, &inputs).0);
    }
    model.microbatch_loss(mb).expect("loss after the last unit")
}

/// Forward of every unit on `mb`: the outputs and the stashes, per unit.
pub(crate) fn forward_all<F: Float>(
    model: &mut Mllm<F>,
    mb: usize,
) -> (Vec<Vec<F>>, Vec<Stash<F>>) {
    let (mut outs, mut stashes): (Vec<Vec<F>>, _) = (Vec::new(), Vec::new());
    for u in 0..model.units() {
        let inputs: Vec<&[F]> = outs.last().map(Vec::as_slice).into_iter().collect();
        let (o, s) = model.forward_unit(u, mb, &inputs);
        outs.push(o);
        stashes.push(s);
    }
    (outs, stashes)
}

/// Relative difference of two vectors in the 2-norm: `|a - b| / max(|a|, |b|)`.
pub(crate) fn rel_diff<F: Float>(a: &[F], b: &[F]) -> f64 {
    assert_eq!(a.len(), b.len());
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    let d = norm(&mut a.iter().zip(b).map(|(x, y)| x.f64() - y.f64()));
    let na = norm(&mut a.iter().map(|x| x.f64()));
    let nb = norm(&mut b.iter().map(|x| x.f64()));
    d / na.max(nb).max(1e-30)
}
