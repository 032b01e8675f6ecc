//! The machine a program is timed on: how point-to-point transfers synchronise
//! ([`Mode`]) and what a transfer costs ([`CommModel`], the link a profile declares),
//! together the [`SimOptions`] of a simulation. Plain data, below everything that
//! reads it: the profile declares a link, the lowering and the bound use its cost,
//! the simulator runs under it (`simulate` re-exports these types).

/// How point-to-point transfers synchronise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Mode {
    /// HCCL-like: a transfer completes when both sides have reached it (the spec's default).
    #[default]
    Rendezvous,
    /// Buffered: a `SEND` completes when reached; a `RECV` waits for its `SEND`.
    Eager,
}

impl Mode {
    /// The modes by name, as docs/spec/program-format.md and every front end spell them.
    pub const NAMES: [(&'static str, Mode); 2] =
        [("rendezvous", Mode::Rendezvous), ("eager", Mode::Eager)];

    /// The mode's name: `rendezvous` or `eager`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Rendezvous => "rendezvous",
            Mode::Eager => "eager",
        }
    }

    /// The mode named `name`, if any.
    pub fn from_name(name: &str) -> Option<Mode> {
        Mode::NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, m)| m)
    }
}

/// Communication cost model: a transfer of `bytes` takes `latency + bytes / bandwidth`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CommModel {
    pub latency: f64,
    pub bandwidth: f64,
}

impl CommModel {
    /// Time to move `bytes`.
    pub fn transfer_time(&self, bytes: f64) -> f64 {
        self.latency + bytes / self.bandwidth
    }
}

/// Simulation options. The default is rendezvous with free communication.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SimOptions {
    pub mode: Mode,
    pub comm: Option<CommModel>,
}

impl SimOptions {
    /// The link model whose transfers hold both of their ranks until they complete:
    /// the communication model under rendezvous (under eager a sender never waits
    /// and a receiver that comes late does not either), else `None`. What
    /// `bound::lower_bound` may count as time no rank can compute in.
    pub fn held_link(&self) -> Option<CommModel> {
        match self.mode {
            Mode::Rendezvous => self.comm,
            Mode::Eager => None,
        }
    }
}
