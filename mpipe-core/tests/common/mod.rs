//! What several test files share.

use mpipe_core::generators::{BodyKind, Weave};

/// One of each body generator (default arguments; `zb2p` both looped and in a V;
/// `zbv(list = search)`),
/// for the operators' property tests. `BodyKind::expr` gives each one's text.
pub(crate) const BODIES: [BodyKind; 9] = [
    BodyKind::GPipe,
    BodyKind::OneFOneB,
    BodyKind::Interleaved { v: 2 },
    BodyKind::ZbH1,
    BodyKind::ZbV,
    BodyKind::DualPipeV,
    BodyKind::ZbList { vshape: true },
    BodyKind::Zb2p {
        v: 1,
        vshape: false,
        lockstep: false,
        encoders: Weave::Inline,
    },
    BodyKind::Zb2p {
        v: 2,
        vshape: true,
        lockstep: false,
        encoders: Weave::Inline,
    },
];
