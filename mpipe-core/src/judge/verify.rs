//! Judge a [`Program`] against the validity rules of `mpipe-program/1`
//! (`docs/spec/program-format.md`, "Validity rules").
//!
//! [`verify`] returns **every** violation of rules 1-5, each naming its rule and,
//! where there is one, the rank and action index it is about, with a message that
//! says what to do. An empty list means the program is valid. It promises:
//!
//! - **total**: any [`Program`] value is judged; nothing panics. Problems the rules do
//!   not name but that make a program meaningless are reported under the closest
//!   rule: a wrong `format` or a `ranks` / `programs` length mismatch, duplicate unit
//!   names, unknown units on compute actions and micro-batches out of range (rule 1);
//!   unit `inputs` naming unknown or later units (rule 2); unknown units on transfers,
//!   `input` transfers of a unit with inputs, a peer that is the rank itself or does
//!   not exist, two sends to / receives from one peer in a batch (rule 3); a `home`
//!   out of range, unknown units on collectives, a root or member that does not
//!   exist, a duplicate member, a root or a listing rank outside the group (rule 4);
//!   negative or non-finite costs and sizes (rule 5);
//! - **deterministic**: violations are sorted by rule, then rank, then action index
//!   (entries without a rank or index first), ties in discovery order;
//! - **fast**: linear in the number of actions apart from sorting inside one
//!   channel's out-of-order transfers: rules 1-4 read the lists in one pass, each
//!   action decoded once (straight from the action unless something about it is
//!   wrong), nothing kept per action but the key of each transfer on its channel's
//!   first side (the other side is compared with it as it is read; a channel whose
//!   sides differ is read again after the pass); all look-ups go through vectors
//!   indexed by `(unit index, micro-batch)`.
//!
//! Rule 5 runs [`simulate`] (free communication) under the requested [`Mode`]
//! ([`verify`] uses rendezvous, as the spec requires); each rank it leaves stuck is
//! one violation. If the program cannot be executed at all, a single rule-5 entry says
//! why termination was not checked.
//!
//! Choices the first agreed version left open (now stated in the spec):
//! - a collective is identified by `(kind, unit, root, set of group members)`; "every
//!   member has that same collective" compares how often each member lists that
//!   identity, and "same relative order" compares, for every two identities of one
//!   kind and unit, their interleaving on each member both groups share;
//! - rule 4's `REDUCE` clause is applied exactly as written, to every unit whose `W`
//!   or `BW` runs away from home (a frozen unit's `BW` included);
//! - the transfer-order clause of rule 3 reports the fewest transfers whose moving
//!   restores a common order (those outside a longest common ordering).

use std::collections::BTreeMap;
use std::fmt;

use crate::ir::program::{
    Action, ActionRef, Batch, CollKind, Dir, NameCache, Op, P2pFields, Program, Tensor, FORMAT,
};
use crate::judge::simulate::{
    joins_batch, simulate, tensor_index, unit_names, Mode, NameMap, SimError, SimOptions,
};

/// Where the validity rules are specified, as the project's messages cite it.
pub const SPEC: &str = "docs/spec/program-format.md";

/// The five validity rules ([`SPEC`], "Validity rules").
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rule {
    Coverage = 1,
    LocalData = 2,
    Matching = 3,
    Parameters = 4,
    Termination = 5,
}

impl Rule {
    /// The rule's number in the spec.
    pub fn number(self) -> u8 {
        self as u8
    }

    /// The rule's name in the spec, lower case.
    pub fn name(self) -> &'static str {
        match self {
            Rule::Coverage => "coverage",
            Rule::LocalData => "local data",
            Rule::Matching => "matching",
            Rule::Parameters => "parameters",
            Rule::Termination => "termination",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rule {} ({})", self.number(), self.name())
    }
}

/// One broken rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub rule: Rule,
    pub rank: Option<usize>,
    /// Index of the action in `programs[rank]`; when present, `message` starts with
    /// the action in backquotes.
    pub index: Option<usize>,
    pub message: String,
}

impl fmt::Display for Violation {
    /// `rule 2 (local data): rank 3, action 17 `B(llm.2,5)`: ...`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.rank, self.index) {
            (Some(r), Some(i)) => write!(f, "{}: rank {r}, action {i} {}", self.rule, self.message),
            (Some(r), None) => write!(f, "{}: rank {r}: {}", self.rule, self.message),
            (None, _) => write!(f, "{}: {}", self.rule, self.message),
        }
    }
}

/// Every violation of `p`, with rule 5 under rendezvous semantics. Empty: valid.
pub fn verify(p: &Program) -> Vec<Violation> {
    verify_mode(p, Mode::Rendezvous)
}

/// Every violation of `p`, with rule 5 checked under `mode`.
pub fn verify_mode(p: &Program, mode: Mode) -> Vec<Violation> {
    check(p, Some(mode))
}

/// Every violation of rules 1-4 only. For a caller that has just run the program to
/// completion under rendezvous (which is what rule 5 asks), such as the derivation.
pub fn verify_static(p: &Program) -> Vec<Violation> {
    check(p, None)
}

fn check(p: &Program, termination: Option<Mode>) -> Vec<Violation> {
    check_as(p, termination, false)
}

/// [`check`], taking no shortcut if `full` (see [`Checker::full`]).
fn check_as(p: &Program, termination: Option<Mode>, full: bool) -> Vec<Violation> {
    let mut c = Checker::new(p);
    c.full = full;
    if full {
        c.straight_m = 0;
    }
    c.run(termination);
    let mut out = c.out;
    out.sort_by_key(|v| (v.rule, v.rank, v.index));
    out
}

const NONE: u32 = u32::MAX;
/// Marks a micro-batch or peer that is out of range (already reported).
const BAD: usize = usize::MAX;

/// An action as the rules read it, its unit an index: decoded once, as the one pass
/// over the lists reaches it ([`Checker::scan`]), and read there by every rule.
#[derive(Clone, Copy, Debug)]
enum V {
    /// Unknown unit: reported, then ignored.
    Bad,
    Compute {
        op: Op,
        unit: u32,
        mb: usize,
    },
    P2p {
        dir: Dir,
        tensor: Tensor,
        unit: u32,
        mb: usize,
        peer: usize,
    },
    Coll {
        kind: CollKind,
        unit: u32,
    },
}

/// A transfer's channel `(from, to)`, its key (`(unit * microbatches + mb) * 3 +
/// tensor`) and whether it is the `SEND`.
type Ends = ((usize, usize), u32, bool);

/// A collective's identity: kind, unit, root, sorted distinct group members.
type Id = (CollKind, u32, usize, Vec<usize>);

struct Checker<'p> {
    p: &'p Program,
    out: Vec<Violation>,
    /// Number of action lists.
    nr: usize,
    /// Ranks that exist: `min(ranks, programs.len())`.
    bound: usize,
    nu: usize,
    m: usize,
    /// Unit names to indices (the first definition wins).
    names: NameMap<'p>,
    inputs: Vec<Vec<u32>>,
    needs_bwd: Vec<bool>,
    /// Successors that need backward.
    succ_nb: Vec<Vec<u32>>,
    /// What the pass reads of each unit, side by side.
    info: Vec<UnitInfo>,
    /// Take no shortcut: every action through [`Checker::resolve`], every
    /// channel's two sides read again ([`Checker::reread`]). The same findings,
    /// slower; for tests that say so.
    full: bool,
    /// The micro-batches an action may have to be read straight from the list: all
    /// (`microbatches`), or none if [`Checker::full`].
    straight_m: usize,
}

/// What the pass ([`Checker::scan`]) reads of a unit.
#[derive(Clone, Copy)]
struct UnitInfo {
    home: usize,
    trainable: bool,
    needs_bwd: bool,
    /// It lists `inputs` (known units or not).
    has_inputs: bool,
}

impl<'p> Checker<'p> {
    fn new(p: &'p Program) -> Checker<'p> {
        let nr = p.programs.len();
        Checker {
            p,
            out: Vec::new(),
            nr,
            bound: p.ranks.min(nr),
            nu: p.units.len(),
            m: p.microbatches,
            names: NameMap::default(),
            inputs: Vec::new(),
            needs_bwd: Vec::new(),
            succ_nb: Vec::new(),
            info: Vec::new(),
            full: false,
            straight_m: p.microbatches,
        }
    }

    fn push(&mut self, rule: Rule, rank: Option<usize>, index: Option<usize>, message: String) {
        self.out.push(Violation {
            rule,
            rank,
            index,
            message,
        });
    }

    /// A violation about action `i` of rank `r`.
    fn at(&mut self, rule: Rule, r: usize, i: usize, msg: impl fmt::Display) {
        let message = format!("`{}`: {msg}", self.p.programs[r][i]);
        self.push(rule, Some(r), Some(i), message);
    }

    fn unit_name(&self, u: u32) -> &'p str {
        &self.p.units[u as usize].name
    }

    fn run(&mut self, termination: Option<Mode>) {
        self.header();
        self.units();
        self.scan();
        if let Some(mode) = termination {
            self.termination(mode);
        }
    }

    // -- structure ---------------------------------------------------------

    fn header(&mut self) {
        let p = self.p;
        if p.format != FORMAT {
            self.push(
                Rule::Coverage,
                None,
                None,
                format!(
                    "`format` is {:?}, but this reader knows only {FORMAT:?}: \
                     set it, or convert the program",
                    p.format
                ),
            );
        }
        if p.ranks != self.nr {
            self.push(
                Rule::Coverage,
                None,
                None,
                format!(
                    "`ranks` is {} but `programs` holds {} action lists: \
                     give every rank exactly one list",
                    p.ranks, self.nr
                ),
            );
        }
    }

    fn units(&mut self) {
        let p = self.p;
        let (names, dups) = unit_names(p);
        for (first, second) in dups {
            self.push(
                Rule::Coverage,
                None,
                None,
                format!(
                    "unit `{}` is defined twice (units {first} and {second}): \
                     give every unit a distinct name",
                    p.units[second].name
                ),
            );
        }
        let nu = self.nu;
        let mut inputs = vec![Vec::new(); nu];
        let mut succ: Vec<Vec<u32>> = vec![Vec::new(); nu];
        for (i, u) in p.units.iter().enumerate() {
            for name in &u.inputs {
                match names.get(name.as_str()) {
                    None => self.push(
                        Rule::LocalData,
                        None,
                        None,
                        format!(
                            "unit `{}` reads input `{name}`, which is not a unit: \
                             fix the name or define the unit before it",
                            u.name
                        ),
                    ),
                    Some(&q) => {
                        if q as usize >= i {
                            self.push(
                                Rule::LocalData,
                                None,
                                None,
                                format!(
                                    "unit `{}` reads input `{name}`, which is not defined \
                                     before it: list `units` in topological order",
                                    u.name
                                ),
                            );
                        }
                        inputs[i].push(q);
                        succ[q as usize].push(i as u32);
                    }
                }
            }
            if u.home >= p.ranks {
                self.push(
                    Rule::Parameters,
                    None,
                    None,
                    format!(
                        "unit `{}` has home rank {}, but the program has {} ranks: \
                         set `home` to an existing rank",
                        u.name, u.home, p.ranks
                    ),
                );
            }
            for (field, value) in u.numbers() {
                if !(value.is_finite() && value >= 0.0) {
                    self.push(
                        Rule::Termination,
                        None,
                        None,
                        format!(
                            "unit `{}`: `{field}` is {value}, but times and sizes must be \
                             finite and >= 0: fix the unit's entry in `units`",
                            u.name
                        ),
                    );
                }
            }
        }
        for l in inputs.iter_mut().chain(succ.iter_mut()) {
            l.sort_unstable();
            l.dedup();
        }
        // Needs backward: reachable from a trainable unit along successor edges.
        let mut nb: Vec<bool> = p.units.iter().map(|u| u.trainable).collect();
        let mut queue: Vec<u32> = (0..nu as u32).filter(|&u| nb[u as usize]).collect();
        while let Some(u) = queue.pop() {
            for &s in &succ[u as usize] {
                if !nb[s as usize] {
                    nb[s as usize] = true;
                    queue.push(s);
                }
            }
        }
        self.succ_nb = succ
            .iter()
            .map(|l| l.iter().copied().filter(|&s| nb[s as usize]).collect())
            .collect();
        self.inputs = inputs;
        self.info = p
            .units
            .iter()
            .zip(&nb)
            .map(|(u, &needs_bwd)| UnitInfo {
                home: u.home,
                trainable: u.trainable,
                needs_bwd,
                has_inputs: !u.inputs.is_empty(),
            })
            .collect();
        self.needs_bwd = nb;
        self.names = names;
    }

    /// Action `i` of rank `r` as the rules read it, with its batch number: what
    /// [`Checker::resolve`] gives, read straight from the action where nothing about
    /// it is wrong (the common case), else from `resolve`, which reports it.
    #[inline(always)]
    fn decode(
        &mut self,
        r: usize,
        i: usize,
        a: &Action,
        recent: &mut NameCache,
    ) -> (V, Option<Batch>) {
        let (op, name, mb) = match a {
            Action::F { unit, mb } => (Op::F, unit, *mb),
            Action::B { unit, mb } => (Op::B, unit, *mb),
            Action::W { unit, mb } => (Op::W, unit, *mb),
            Action::BW { unit, mb } => (Op::BW, unit, *mb),
            Action::RF { unit, mb } => (Op::RF, unit, *mb),
            // Each arm builds the fields itself: one dispatch per action (a second
            // through `Action::p2p_fields` costs 3% of the pass).
            &Action::SEND {
                tensor,
                ref unit,
                mb,
                peer,
                batch,
            } => {
                let t = P2pFields {
                    dir: Dir::Send,
                    tensor,
                    unit,
                    mb,
                    peer,
                    batch,
                };
                return (self.transfer(r, i, a, t, recent), batch);
            }
            &Action::RECV {
                tensor,
                ref unit,
                mb,
                peer,
                batch,
            } => {
                let t = P2pFields {
                    dir: Dir::Recv,
                    tensor,
                    unit,
                    mb,
                    peer,
                    batch,
                };
                return (self.transfer(r, i, a, t, recent), batch);
            }
            Action::BCAST { unit, .. } | Action::REDUCE { unit, .. } => {
                let found = recent.get(unit, |n| self.names.get(n).copied());
                return (self.resolve_at(r, i, a, found), None);
            }
        };
        let found = recent.get(name, |n| self.names.get(n).copied());
        let v = match found {
            Some(unit) if (mb as usize) < self.straight_m => V::Compute {
                op,
                unit,
                mb: mb as usize,
            },
            _ => self.resolve_at(r, i, a, found),
        };
        (v, None)
    }

    /// [`Checker::decode`] of a transfer.
    #[inline(always)]
    fn transfer(
        &mut self,
        r: usize,
        i: usize,
        a: &Action,
        t: P2pFields<'_>,
        recent: &mut NameCache,
    ) -> V {
        let found = recent.get(t.unit, |n| self.names.get(n).copied());
        let (dir, tensor, mb, peer) = (t.dir, t.tensor, t.mb as usize, t.peer as usize);
        match found {
            Some(unit)
                if mb < self.straight_m
                    && peer != r
                    && peer < self.bound
                    && (tensor != Tensor::Input || !self.info[unit as usize].has_inputs) =>
            {
                V::P2p {
                    dir,
                    tensor,
                    unit,
                    mb,
                    peer,
                }
            }
            _ => self.resolve_at(r, i, a, found),
        }
    }

    /// [`Checker::resolve`] of action `a`, `i` of rank `r`: a collective, or an
    /// action with something to report.
    #[cold]
    #[inline(never)]
    fn resolve_at(&mut self, r: usize, i: usize, a: &Action, unit: Option<u32>) -> V {
        self.resolve(r, i, a.view(), a.unit(), unit)
    }

    /// Action `i` of rank `r`, its unit `unit` (`None`: no unit has its name), as the
    /// rules read it; what is wrong with its numbers reported here (rules 1, 3 and 4).
    fn resolve(
        &mut self,
        r: usize,
        i: usize,
        view: ActionRef<'_>,
        name: &str,
        unit: Option<u32>,
    ) -> V {
        let p = self.p;
        match view {
            ActionRef::Compute(c) => match unit {
                None => {
                    self.at(
                        Rule::Coverage,
                        r,
                        i,
                        format_args!("no unit is called `{name}`: use a name listed in `units`"),
                    );
                    V::Bad
                }
                Some(unit) => {
                    let mb = if c.mb < self.m {
                        c.mb
                    } else {
                        self.mb_range(Rule::Coverage, r, i, c.mb);
                        BAD
                    };
                    V::Compute { op: c.op, unit, mb }
                }
            },
            ActionRef::P2p(t) => {
                let mut peer = t.peer;
                if t.peer == r {
                    self.at(
                        Rule::Matching,
                        r,
                        i,
                        "the peer is this rank itself: name the other rank of the transfer",
                    );
                    peer = BAD;
                } else if t.peer >= self.bound {
                    self.at(
                        Rule::Matching,
                        r,
                        i,
                        format_args!(
                            "rank {} does not exist (the program has {} ranks): \
                             name an existing rank",
                            t.peer, p.ranks
                        ),
                    );
                    peer = BAD;
                }
                match unit {
                    None => {
                        self.at(
                            Rule::Matching,
                            r,
                            i,
                            format_args!(
                                "no unit is called `{name}`: use a name listed in `units`"
                            ),
                        );
                        V::Bad
                    }
                    Some(unit) => {
                        if t.tensor == Tensor::Input && !p.units[unit as usize].inputs.is_empty() {
                            self.at(
                                Rule::Matching,
                                r,
                                i,
                                format_args!(
                                    "an `input` transfer carries the raw micro-batch of \
                                     a unit with no inputs, but `{name}` has inputs: \
                                     transfer `act` of its inputs instead"
                                ),
                            );
                        }
                        let mb = if t.mb < self.m {
                            t.mb
                        } else {
                            self.mb_range(Rule::Matching, r, i, t.mb);
                            BAD
                        };
                        V::P2p {
                            dir: t.dir,
                            tensor: t.tensor,
                            unit,
                            mb,
                            peer,
                        }
                    }
                }
            }
            ActionRef::Coll(c) => {
                let ranks = p.ranks;
                if c.root >= self.bound {
                    self.at(
                        Rule::Parameters,
                        r,
                        i,
                        format_args!(
                            "root {} does not exist (the program has {ranks} ranks): \
                             use the unit's home rank",
                            c.root
                        ),
                    );
                } else if !c.group.contains(&c.root) {
                    self.at(
                        Rule::Parameters,
                        r,
                        i,
                        format_args!("root {} is not in the group: add it", c.root),
                    );
                }
                if !c.group.contains(&r) {
                    self.at(
                        Rule::Parameters,
                        r,
                        i,
                        format_args!(
                            "rank {r} lists this collective but is not in its group: \
                             add {r} to the group, or remove the action"
                        ),
                    );
                }
                for (k, &g) in c.group.iter().enumerate() {
                    if g >= self.bound {
                        self.at(
                            Rule::Parameters,
                            r,
                            i,
                            format_args!(
                                "group member {g} does not exist (the program has \
                                 {ranks} ranks): remove it"
                            ),
                        );
                    } else if c.group[..k].contains(&g) {
                        self.at(
                            Rule::Parameters,
                            r,
                            i,
                            format_args!("rank {g} appears twice in the group: list it once"),
                        );
                    }
                }
                match unit {
                    None => {
                        self.at(
                            Rule::Parameters,
                            r,
                            i,
                            format_args!(
                                "no unit is called `{name}`: use a name listed in `units`"
                            ),
                        );
                        V::Bad
                    }
                    Some(unit) => V::Coll { kind: c.kind, unit },
                }
            }
        }
    }

    fn mb_range(&mut self, rule: Rule, r: usize, i: usize, mb: usize) {
        let m = self.m;
        self.at(
            rule,
            r,
            i,
            format_args!(
                "micro-batch {mb} does not exist (the program has {m}): \
                 fix `mb` or raise `microbatches`"
            ),
        );
    }

    /// Rules 1-4 in one pass over the lists: each action is decoded once
    /// ([`Checker::resolve`]) and read by every rule's part of the pass in turn
    /// (rule 1's counts, rule 2's data on the rank, rule 3's channels and batches,
    /// rule 4's parameters), each keeping what it finds apart; then each rule's
    /// findings and what it concludes from the whole pass, in the rules' order
    /// (violations tie only within one rule: the order each rule finds its own is
    /// the order of a pass of its own).
    fn scan(&mut self) {
        let p = self.p;
        let (nu, m, nr) = (self.nu, self.m, self.nr);
        let total: usize = p.programs.iter().map(Vec::len).sum();
        let cells = nu.checked_mul(m);
        // `(unit, mb)` tables fit in memory.
        let dense = matches!(cells, Some(c) if c <= total.saturating_add(65_536));
        let cells = if dense { nu * m } else { 0 };

        // Rule 1: per op kind (F, B, W, BW) of each (unit, mb), how many
        // (saturating) and where the first one is.
        let mut tally = vec![Tally::EMPTY; cells];
        let mut cover: Vec<(usize, usize, String)> = Vec::new();

        // Rule 2 (and rule 3's "send after the producer"): what each (unit, mb)
        // has on the rank so far.
        const FWD: u8 = 1;
        const BWD: u8 = 2;
        const BONLY: u8 = 4;
        const RACT: u8 = 8;
        const RGRAD: u8 = 16;
        let (ahead_msgs, left, ahead) = if dense {
            self.prefetched()
        } else {
            Default::default()
        };
        let mut seen = vec![0u8; cells];
        let mut touched_cells: Vec<usize> = Vec::new();
        let mut local: Vec<(Rule, usize, usize, String)> = Vec::new();

        // Rule 3: the channels (from, to), each with the keys of the side the pass
        // reaches first (4 bytes a transfer), in list order ([`Chan`]).
        let keys = cells * 3;
        let matching = dense && u32::try_from(keys).is_ok();
        let mut chans: Vec<Chan> = Vec::new();
        // A channel's place in `chans`: in a table of ranks x ranks cells where that
        // is no larger than the program (no tree walk per action), else in a map.
        let mut table: Vec<u32> = if nr.checked_mul(nr).is_some_and(|c| c <= total) {
            vec![NONE; nr * nr]
        } else {
            Vec::new()
        };
        let mut map: BTreeMap<(usize, usize), usize> = BTreeMap::new();

        // Rule 3's batches: at most one SEND to and one RECV from each peer per
        // batch; `serial` numbers the batches of two or more.
        let mut stamps = Stamps {
            last: vec![(0, 0); nr * 2],
        };
        let mut serial = 0usize;
        let mut batches: Vec<(usize, usize, String)> = Vec::new();

        // Rule 4: per unit, on the current rank: first compute, last W/BW, first
        // BCAST, last REDUCE.
        let mut first_compute = vec![NONE; nu];
        let mut last_wbw = vec![NONE; nu];
        let mut first_bcast = vec![NONE; nu];
        let mut last_reduce = vec![NONE; nu];
        let mut touched_units: Vec<usize> = Vec::new();
        let mut in_touched = vec![false; nu];
        let mut params: Vec<(usize, usize, String)> = Vec::new();
        // Collective identities: each with its first (rank, index); per (id, rank)
        // how often; per (kind, unit, rank) the identities in list order.
        let mut ids: BTreeMap<Id, usize> = BTreeMap::new();
        let mut id_list: Vec<(Id, usize, usize)> = Vec::new();
        let mut counts: BTreeMap<(usize, usize), usize> = BTreeMap::new();
        let mut seqs: BTreeMap<(CollKind, u32, usize), Vec<(usize, usize)>> = BTreeMap::new();

        let mut recent = NameCache::new();
        for (r, list) in p.programs.iter().enumerate() {
            for &c in &touched_cells {
                seen[c] = 0;
            }
            touched_cells.clear();
            for &u in &touched_units {
                in_touched[u] = false;
                first_compute[u] = NONE;
                last_wbw[u] = NONE;
                first_bcast[u] = NONE;
                last_reduce[u] = NONE;
            }
            touched_units.clear();
            // The batch number of the action before, how many actions the operation
            // holds so far and its first one, if a transfer the batch rule reads.
            let mut prev_batch: Option<Batch> = None;
            let mut run = 0usize;
            let mut run_first: Option<(usize, Dir, usize)> = None;
            for (i, a) in list.iter().enumerate() {
                let (v, batch) = self.decode(r, i, a, &mut recent);

                // Rule 3's batches: operations split as `split_ops` splits them
                // (only a transfer with a batch number joins the action before).
                if joins_batch(prev_batch, batch) {
                    let member = match v {
                        V::P2p { dir, peer, .. } if peer != BAD => Some((i, dir, peer)),
                        _ => None,
                    };
                    run += 1;
                    if run == 2 {
                        serial += 1;
                        if let Some(f) = run_first {
                            stamps.stamp(r, f, serial, &mut batches);
                        }
                    }
                    if let Some(x) = member {
                        stamps.stamp(r, x, serial, &mut batches);
                    }
                } else if batch.is_some() {
                    run = 1;
                    run_first = match v {
                        V::P2p { dir, peer, .. } if peer != BAD => Some((i, dir, peer)),
                        _ => None,
                    };
                }
                prev_batch = batch;

                match v {
                    V::Bad => {}
                    V::Compute { op, unit, mb } => {
                        let u = unit as usize;
                        if dense && mb != BAD {
                            let cell = u * m + mb;
                            // Rule 1.
                            let UnitInfo {
                                trainable,
                                needs_bwd: nb,
                                ..
                            } = self.info[u];
                            match op {
                                Op::W if !trainable => cover.push((
                                    r,
                                    i,
                                    "W of a frozen unit (`trainable: false`) is not allowed: \
                                     remove it"
                                        .to_string(),
                                )),
                                Op::B | Op::BW if !nb => cover.push((
                                    r,
                                    i,
                                    "this unit needs no backward (it is frozen and so are all \
                                     its transitive inputs), so no B or BW of it is allowed: \
                                     remove it"
                                        .to_string(),
                                )),
                                _ => {}
                            }
                            if op != Op::RF {
                                let k = match op {
                                    Op::F => 0,
                                    Op::B => 1,
                                    Op::W => 2,
                                    _ => 3,
                                };
                                let t = &mut tally[cell];
                                let n = &mut t.count[k];
                                if *n == 0 {
                                    t.first[k] = (r as u32, i as u32);
                                } else {
                                    let (fr, fi) = t.first[k];
                                    cover.push((
                                        r,
                                        i,
                                        format!(
                                            "another {}({},{mb}) (the first is rank {fr}, \
                                             action {fi}): exactly one is allowed; remove this one",
                                            op.as_str(),
                                            self.unit_name(unit)
                                        ),
                                    ));
                                }
                                *n = n.saturating_add(1);
                            }
                            // Rule 2.
                            let name = self.unit_name(unit);
                            let bit = match op {
                                Op::F | Op::RF => {
                                    // A forward for the next step reads its inputs'
                                    // next-step copies, made in this step.
                                    let reader_ahead = ahead.contains(&(unit, mb));
                                    for &q in &self.inputs[u] {
                                        if seen[q as usize * m + mb] & (FWD | RACT) == 0
                                            && (reader_ahead || !left.contains(&(r, q, mb)))
                                        {
                                            let q = self.unit_name(q);
                                            local.push((
                                                Rule::LocalData,
                                                r,
                                                i,
                                                format!(
                                                    "reads act({q},{mb}), but no F({q},{mb}), \
                                                     RF({q},{mb}) or RECV act({q},{mb}) comes \
                                                     earlier on rank {r}: add one before it"
                                                ),
                                            ));
                                        }
                                    }
                                    FWD
                                }
                                Op::B | Op::BW => {
                                    if seen[cell] & FWD == 0 {
                                        local.push((
                                            Rule::LocalData,
                                            r,
                                            i,
                                            format!(
                                                "needs the activations of F({name},{mb}), but \
                                                 no F({name},{mb}) or RF({name},{mb}) comes \
                                                 earlier on rank {r}: add one before it (RF \
                                                 recomputes it)"
                                            ),
                                        ));
                                    }
                                    for &s in &self.succ_nb[u] {
                                        if seen[s as usize * m + mb] & (BWD | RGRAD) == 0 {
                                            let s = self.unit_name(s);
                                            local.push((
                                                Rule::LocalData,
                                                r,
                                                i,
                                                format!(
                                                    "reads grad({s},{mb}), but no B({s},{mb}), \
                                                     BW({s},{mb}) or RECV grad({s},{mb}) comes \
                                                     earlier on rank {r}: add one before it"
                                                ),
                                            ));
                                        }
                                    }
                                    if op == Op::B {
                                        BWD | BONLY
                                    } else {
                                        BWD
                                    }
                                }
                                Op::W => {
                                    if seen[cell] & BONLY == 0 {
                                        local.push((
                                            Rule::LocalData,
                                            r,
                                            i,
                                            format!(
                                                "needs B({name},{mb}) earlier on rank {r}: \
                                                 move it after that B"
                                            ),
                                        ));
                                    }
                                    0
                                }
                            };
                            if bit != 0 {
                                if seen[cell] == 0 {
                                    touched_cells.push(cell);
                                }
                                seen[cell] |= bit;
                            }
                        }
                        // Rule 4 (which asks nothing of a unit on its home rank).
                        if self.info[u].home != r {
                            if first_compute[u] == NONE {
                                first_compute[u] = i as u32;
                            }
                            if matches!(op, Op::W | Op::BW) {
                                last_wbw[u] = i as u32;
                            }
                            if !in_touched[u] {
                                in_touched[u] = true;
                                touched_units.push(u);
                            }
                        }
                    }
                    V::P2p {
                        dir,
                        tensor,
                        unit,
                        mb,
                        peer,
                    } if dense && mb != BAD => {
                        // Rule 2, and rule 3's "send after the producer".
                        let cell = unit as usize * m + mb;
                        let bit = match (dir, tensor) {
                            (Dir::Recv, Tensor::Act) => RACT,
                            (Dir::Recv, Tensor::Grad) => RGRAD,
                            (Dir::Send, Tensor::Act) if seen[cell] & FWD == 0 => {
                                let name = self.unit_name(unit);
                                local.push((
                                    Rule::Matching,
                                    r,
                                    i,
                                    format!(
                                        "sends act({name},{mb}) before rank {r} produces it: \
                                         put it after F({name},{mb}) or RF({name},{mb})"
                                    ),
                                ));
                                0
                            }
                            (Dir::Send, Tensor::Grad) if seen[cell] & BWD == 0 => {
                                let name = self.unit_name(unit);
                                local.push((
                                    Rule::Matching,
                                    r,
                                    i,
                                    format!(
                                        "sends grad({name},{mb}) before rank {r} produces it: \
                                         put it after B({name},{mb}) or BW({name},{mb})"
                                    ),
                                ));
                                0
                            }
                            _ => 0,
                        };
                        if bit != 0 {
                            if seen[cell] == 0 {
                                touched_cells.push(cell);
                            }
                            seen[cell] |= bit;
                        }
                        // Rule 3: the transfer on its channel: kept if this rank lists
                        // the channel's first side, else compared with it.
                        if matching && peer != BAD {
                            let key = (unit as usize * m + mb) * 3 + tensor_index(tensor) as usize;
                            let c =
                                channel(&mut chans, &mut table, &mut map, nr, dir.ends(r, peer));
                            chans[c].read(r < peer, key as u32);
                        }
                    }
                    V::P2p { .. } => {}
                    V::Coll { kind, unit } => {
                        // Rule 4.
                        let u = unit as usize;
                        match kind {
                            CollKind::Bcast if first_bcast[u] == NONE => first_bcast[u] = i as u32,
                            CollKind::Reduce => last_reduce[u] = i as u32,
                            _ => {}
                        }
                        if let ActionRef::Coll(c) = a.view() {
                            let mut group = c.group.to_vec();
                            group.sort_unstable();
                            group.dedup();
                            let key: Id = (kind, unit, c.root, group);
                            let id = match ids.get(&key) {
                                Some(&id) => id,
                                None => {
                                    let id = id_list.len();
                                    ids.insert(key.clone(), id);
                                    id_list.push((key, r, i));
                                    id
                                }
                            };
                            *counts.entry((id, r)).or_insert(0) += 1;
                            seqs.entry((kind, unit, r)).or_default().push((id, i));
                        }
                        if !in_touched[u] {
                            in_touched[u] = true;
                            touched_units.push(u);
                        }
                    }
                }
            }
            // Rule 4, the rank's end: parameters fetched and gradients sent home.
            for &u in &touched_units {
                let unit = &p.units[u];
                if unit.home == r {
                    continue;
                }
                let name = &unit.name;
                let home = unit.home;
                let fc = first_compute[u];
                if unit.trainable && fc != NONE && (first_bcast[u] == NONE || first_bcast[u] > fc) {
                    params.push((
                        r,
                        fc as usize,
                        format!(
                            "rank {r} runs trainable unit `{name}`, whose parameters live on \
                             rank {home}, but takes part in no BCAST({name}) before this: add \
                             a BCAST({name}) from rank {home} to a group holding rank {r} \
                             earlier in rank {r}'s list"
                        ),
                    ));
                }
                let lw = last_wbw[u];
                if lw != NONE && (last_reduce[u] == NONE || last_reduce[u] < lw) {
                    params.push((
                        r,
                        lw as usize,
                        format!(
                            "rank {r} computes weight gradients of `{name}`, whose home is \
                             rank {home}, but takes part in no REDUCE({name}) after its last \
                             W/BW (this one): add a REDUCE({name}) to rank {home} after it"
                        ),
                    ));
                }
            }
        }
        drop((seen, touched_cells, left, ahead, table, map));
        if matching {
            self.reread(&mut chans);
        }
        drop((
            first_compute,
            last_wbw,
            first_bcast,
            last_reduce,
            in_touched,
        ));

        if dense {
            for (r, i, msg) in cover {
                self.at(Rule::Coverage, r, i, msg);
            }
            self.coverage(&tally);
            drop(tally);
            for message in ahead_msgs {
                self.push(Rule::LocalData, None, None, message);
            }
            for (rule, r, i, msg) in local {
                self.at(rule, r, i, msg);
            }
            if matching {
                self.matching(chans);
            } else {
                self.push(
                    Rule::Matching,
                    None,
                    None,
                    format!(
                        "{} units x {} micro-batches are too many to match transfers by key \
                         (at most {} keys): lower `microbatches` or the number of units",
                        self.nu,
                        self.m,
                        u32::MAX
                    ),
                );
            }
        } else {
            self.push(
                Rule::Coverage,
                None,
                None,
                format!(
                    "the program declares {} units x {} micro-batches but holds only {total} \
                     actions, so most (unit, micro-batch) pairs have no F: check `microbatches` \
                     (rules 1-3 were not checked further)",
                    self.nu, self.m
                ),
            );
        }
        for (r, i, msg) in batches {
            self.at(Rule::Matching, r, i, msg);
        }
        for (r, i, msg) in params {
            self.at(Rule::Parameters, r, i, msg);
        }
        self.collectives(&id_list, &counts, &seqs);
    }

    /// Rule 1's conclusions from the counts of the pass ([`Checker::scan`]): every
    /// (unit, mb) computed, backward and weight gradients as its unit needs them.
    fn coverage(&mut self, tally: &[Tally]) {
        for u in 0..self.nu {
            let unit = &self.p.units[u];
            let name = &unit.name;
            for mb in 0..self.m {
                let cell = u * self.m + mb;
                let Tally { count, first } = &tally[cell];
                let [nf, nbk, nw, nbw] = *count;
                if nf == 0 {
                    self.push(
                        Rule::Coverage,
                        None,
                        None,
                        format!("no F({name},{mb}) anywhere: add it to one rank's list"),
                    );
                }
                if self.needs_bwd[u] {
                    if nbk == 0 && nbw == 0 {
                        self.push(
                            Rule::Coverage,
                            None,
                            None,
                            format!(
                                "unit `{name}` needs backward, but there is no B({name},{mb}) \
                                 or BW({name},{mb}) anywhere: add one"
                            ),
                        );
                    } else if nbk > 0 && nbw > 0 {
                        let (r, i) = first[3];
                        let (br, bi) = first[1];
                        self.at(
                            Rule::Coverage,
                            r as usize,
                            i as usize,
                            format_args!(
                                "B({name},{mb}) also exists (rank {br}, action {bi}): \
                                 use either B (with W) or BW, not both"
                            ),
                        );
                    }
                }
                if unit.trainable && nbk > 0 {
                    let (br, bi) = first[1];
                    if nw == 0 {
                        self.at(
                            Rule::Coverage,
                            br as usize,
                            bi as usize,
                            format_args!(
                                "the unit is trainable and its backward is split, but there is \
                                 no W({name},{mb}): add it on rank {br} after this B (or fuse \
                                 both into BW)"
                            ),
                        );
                    } else {
                        let (wr, wi) = first[2];
                        if wr != br {
                            self.at(
                                Rule::Coverage,
                                wr as usize,
                                wi as usize,
                                format_args!(
                                    "W runs on rank {wr} but B({name},{mb}) runs on rank {br}: \
                                     move the W to rank {br}"
                                ),
                            );
                        }
                    }
                } else if unit.trainable && nw > 0 {
                    let (wr, wi) = first[2];
                    self.at(
                        Rule::Coverage,
                        wr as usize,
                        wi as usize,
                        format_args!(
                            "W({name},{mb}) belongs with a B({name},{mb}), and there is \
                             none (a fused BW already includes W): remove this W, or use B \
                             and W instead of BW"
                        ),
                    );
                }
            }
        }
    }

    // -- rule 2's entries left by the previous step ---------------------------

    /// What a step's prefetched forwards (see [`Program::prefetch`]) leave: the
    /// entries' own problems (rule 2, each a message, including that a prefetched
    /// unit's inputs are prefetched for the same micro-batch); the `(rank, unit,
    /// mb)` cells whose activation the previous step left on the rank, on every rank
    /// that computes or receives a prefetched forward; and the `(unit, mb)` entries.
    #[allow(clippy::type_complexity)]
    fn prefetched(
        &self,
    ) -> (
        Vec<String>,
        std::collections::BTreeSet<(usize, u32, usize)>,
        std::collections::BTreeSet<(u32, usize)>,
    ) {
        let mut messages = Vec::new();
        let mut cells = std::collections::BTreeSet::new();
        let mut wanted = std::collections::BTreeSet::new();
        if self.p.prefetch.is_empty() {
            return (messages, cells, wanted);
        }
        for e in &self.p.prefetch {
            let Some(u) = self.p.units.iter().position(|x| *x.name == *e.unit) else {
                messages.push(format!("`prefetch` names unknown unit `{}`", e.unit));
                continue;
            };
            if e.mb >= self.m {
                messages.push(format!(
                    "`prefetch` names micro-batch {} of `{}`, beyond the step's {}",
                    e.mb, e.unit, self.m
                ));
                continue;
            }
            if self.p.units[u].trainable || self.needs_bwd.get(u).copied().unwrap_or(false) {
                messages.push(format!(
                    "`prefetch` names `{}`, which has a backward: only a frozen unit's \
                     forward can run a step ahead (the next step's would read parameters \
                     this step updates)",
                    e.unit
                ));
                continue;
            }
            wanted.insert((u as u32, e.mb));
        }
        // Every F and RECV act of a prefetched (unit, mb), by rank (a unit no unit
        // is called, or a micro-batch out of range, is never one).
        for (r, list) in self.p.programs.iter().enumerate() {
            for a in list {
                let (name, mb) = match a.view() {
                    ActionRef::Compute(c) if c.op == Op::F => (c.unit, c.mb),
                    ActionRef::P2p(t) if t.dir == Dir::Recv && t.tensor == Tensor::Act => {
                        (t.unit, t.mb)
                    }
                    _ => continue,
                };
                let Some(&unit) = self.names.get(name) else {
                    continue;
                };
                if wanted.contains(&(unit, mb)) {
                    cells.insert((r, unit, mb));
                }
            }
        }
        for &(u, mb) in &wanted {
            for &q in self.inputs.get(u as usize).into_iter().flatten() {
                if !wanted.contains(&(q, mb)) {
                    messages.push(format!(
                        "`prefetch` names `{}` for micro-batch {mb} but not its input `{}`: a \
                         forward for the next step cannot read this step's activation; \
                         prefetch `{}` for micro-batch {mb} too, or neither",
                        self.unit_name(u),
                        self.unit_name(q),
                        self.unit_name(q),
                    ));
                }
            }
        }
        (messages, cells, wanted)
    }

    // -- rule 3 ------------------------------------------------------------

    /// Rule 3's conclusions from every channel's transfers, as the pass listed them
    /// ([`Checker::scan`]): each sent once and received once, in one order.
    fn matching(&mut self, mut chans: Vec<Chan>) {
        let m = self.m as u64;
        let keys = self.nu * self.m * 3;
        let mut cnt_s = vec![0u8; keys];
        // The receives' counts and both sides' first positions, made for the first
        // channel whose two sides differ (none in a valid program).
        let mut apart: Option<(Vec<u8>, Vec<u32>, Vec<u32>)> = None;
        let mut found: Vec<(usize, usize, String)> = Vec::new();
        let describe = |key: u32| -> String {
            let (key, m) = (u64::from(key), m);
            let t = match key % 3 {
                0 => "act",
                1 => "grad",
                _ => "input",
            };
            let cell = key / 3;
            let (u, mb) = (cell / m, cell % m);
            format!("{t}({},{mb})", self.p.units[u as usize].name)
        };
        // Where channel `ch`'s sends (`send`) or receives are in rank `r`'s list, in
        // order: found again only for a channel with a violation to report.
        let indices = |r: usize, ch: (usize, usize), send: bool| -> Vec<u32> {
            let on = |a: &Action| matches!(self.transfer_of(r, a), Some((c, _, s)) if c == ch && s == send);
            (0..self.p.programs[r].len() as u32)
                .filter(|&i| on(&self.p.programs[r][i as usize]))
                .collect()
        };
        // By channel, as a map by `(from, to)` would list them.
        chans.sort_unstable_by_key(|c| c.ends);
        for ch in &chans {
            let (a, b) = ch.ends;
            let (sends, recvs) = ch.sides();
            // The index of the send (receive) at `pos` in the channel.
            let mut send_at = None::<Vec<u32>>;
            let mut recv_at = None::<Vec<u32>>;
            let mut send_index =
                |pos: usize| send_at.get_or_insert_with(|| indices(a, (a, b), true))[pos];
            let mut recv_index =
                |pos: usize| recv_at.get_or_insert_with(|| indices(b, (a, b), false))[pos];
            // The common case: both sides list the same transfers in the same order.
            // Then the only violation there can be is a transfer listed twice (each
            // side lists it twice: two duplicates), found by one pass.
            if ch.sides.is_none() || sends == recvs {
                let mut repeats = false;
                for &k in sends {
                    let k = k as usize;
                    repeats |= cnt_s[k] != 0;
                    cnt_s[k] = 1;
                }
                for &k in sends {
                    cnt_s[k as usize] = 0;
                }
                if !repeats {
                    continue;
                }
            }
            let (cnt_r, first_s, first_r) =
                apart.get_or_insert_with(|| (vec![0u8; keys], vec![NONE; keys], vec![NONE; keys]));
            for (pos, &k) in sends.iter().enumerate() {
                let k = k as usize;
                if cnt_s[k] == 0 {
                    first_s[k] = pos as u32;
                }
                cnt_s[k] = cnt_s[k].saturating_add(1);
            }
            for (pos, &k) in recvs.iter().enumerate() {
                let k = k as usize;
                if cnt_r[k] == 0 {
                    first_r[k] = pos as u32;
                }
                cnt_r[k] = cnt_r[k].saturating_add(1);
            }
            // Matched transfers in send order, with their receive positions.
            let mut matched: Vec<(u32, u32)> = Vec::new();
            for (pos, &k) in sends.iter().enumerate() {
                let ku = k as usize;
                if first_s[ku] != pos as u32 {
                    let fi = send_index(first_s[ku] as usize);
                    found.push((
                        a,
                        send_index(pos) as usize,
                        format!(
                            "rank {a} already sends {} to rank {b} at action {fi}: each \
                             transfer is sent exactly once; remove the duplicate",
                            describe(k)
                        ),
                    ));
                } else if cnt_r[ku] == 0 {
                    found.push((
                        a,
                        send_index(pos) as usize,
                        format!(
                            "no matching `RECV {}<-{a}` on rank {b}: add it to rank {b}'s list, \
                             or remove this SEND",
                            describe(k)
                        ),
                    ));
                } else if cnt_s[ku] == 1 && cnt_r[ku] == 1 {
                    matched.push((pos as u32, first_r[ku]));
                }
            }
            for (pos, &k) in recvs.iter().enumerate() {
                let ku = k as usize;
                if first_r[ku] != pos as u32 {
                    let fj = recv_index(first_r[ku] as usize);
                    found.push((
                        b,
                        recv_index(pos) as usize,
                        format!(
                            "rank {b} already receives {} from rank {a} at action {fj}: each \
                             transfer is received exactly once; remove the duplicate",
                            describe(k)
                        ),
                    ));
                } else if cnt_s[ku] == 0 {
                    found.push((
                        b,
                        recv_index(pos) as usize,
                        format!(
                            "no matching `SEND {}->{b}` on rank {a}: add it to rank {a}'s list, \
                             or remove this RECV",
                            describe(k)
                        ),
                    ));
                }
            }
            // Same order: keep a longest run on which both orders agree, report the rest.
            let ranks: Vec<u32> = matched.iter().map(|&(_, rp)| rp).collect();
            // Received in the order sent (the common case): all are kept.
            let in_order = ranks.windows(2).all(|w| w[0] < w[1]);
            let keep = if in_order {
                Vec::new()
            } else {
                longest_increasing(&ranks)
            };
            for (n, &(sp, rp)) in matched.iter().enumerate() {
                if !in_order && !keep[n] {
                    let i = send_index(sp as usize) as usize;
                    let j = recv_index(rp as usize);
                    found.push((
                        a,
                        i,
                        format!(
                            "rank {a} sends to rank {b} in a different order than rank {b} \
                             receives (this transfer's RECV is rank {b}, action {j}): list the \
                             transfers between the two ranks in the same order on both"
                        ),
                    ));
                }
            }
            for &k in sends.iter().chain(recvs) {
                let k = k as usize;
                cnt_s[k] = 0;
                cnt_r[k] = 0;
                first_s[k] = NONE;
                first_r[k] = NONE;
            }
        }
        for (r, i, msg) in found {
            self.at(Rule::Matching, r, i, msg);
        }
    }

    /// Both sides of every channel whose sides the pass found apart, read again
    /// from the lists (one more pass, only when there is one).
    fn reread(&self, chans: &mut [Chan]) {
        let mut apart: BTreeMap<(usize, usize), usize> = BTreeMap::new();
        for (c, ch) in chans.iter_mut().enumerate() {
            ch.apart |= self.full || ch.next != ch.keys.len();
            if ch.apart {
                apart.insert(ch.ends, c);
                ch.sides = Some(Default::default());
            }
        }
        if apart.is_empty() {
            return;
        }
        for (r, list) in self.p.programs.iter().enumerate() {
            for a in list {
                let Some((ends, key, send)) = self.transfer_of(r, a) else {
                    continue;
                };
                let Some(&c) = apart.get(&ends) else {
                    continue;
                };
                if let Some((sends, recvs)) = &mut chans[c].sides {
                    if send {
                        sends.push(key);
                    } else {
                        recvs.push(key);
                    }
                }
            }
        }
    }

    /// Transfer `a` of rank `r`'s channel, key and direction, as the pass reads it:
    /// `None` for another action, or one whose unit, micro-batch or peer is wrong.
    fn transfer_of(&self, r: usize, a: &Action) -> Option<Ends> {
        let ActionRef::P2p(t) = a.view() else {
            return None;
        };
        let unit = *self.names.get(t.unit)?;
        let fits = t.mb < self.m && t.peer != r && t.peer < self.bound;
        let key = (unit as usize * self.m + t.mb) * 3 + tensor_index(t.tensor) as usize;
        fits.then(|| (t.dir.ends(r, t.peer), key as u32, t.dir == Dir::Send))
    }

    // -- rule 4 ------------------------------------------------------------

    /// Rule 4's conclusions on collectives from the pass ([`Checker::scan`]): each
    /// identity with its first `(rank, index)` (`ids`), how often each rank lists it
    /// (`counts`, by `(id, rank)`), and per `(kind, unit, rank)` the identities in
    /// list order with their indices (`seqs`).
    #[allow(clippy::type_complexity)]
    fn collectives(
        &mut self,
        id_list: &[(Id, usize, usize)],
        counts: &BTreeMap<(usize, usize), usize>,
        seqs: &BTreeMap<(CollKind, u32, usize), Vec<(usize, usize)>>,
    ) {
        let p = self.p;
        // Every member lists every collective of its groups as often as anyone.
        for (id, ((_, _, _, group), fr, fi)) in id_list.iter().enumerate() {
            let (most_rank, most) = counts
                .range((id, 0)..=(id, usize::MAX))
                .map(|(&(_, r), &n)| (r, n))
                .fold((0, 0), |best, x| if x.1 > best.1 { x } else { best });
            for &g in group {
                if g >= self.bound {
                    continue;
                }
                let have = counts.get(&(id, g)).copied().unwrap_or(0);
                if have < most {
                    let what = &p.programs[*fr][*fi];
                    self.push(
                        Rule::Parameters,
                        Some(g),
                        None,
                        format!(
                            "rank {g} is in the group of `{what}`, which rank {most_rank} lists \
                             {most} time(s), but rank {g} lists it {have} time(s): every member \
                             must take part; add it to rank {g}'s list"
                        ),
                    );
                }
            }
        }

        // Same relative order, for every two identities of one kind and unit.
        let mut by_unit: BTreeMap<(CollKind, u32), Vec<usize>> = BTreeMap::new();
        for (id, ((kind, unit, _, _), _, _)) in id_list.iter().enumerate() {
            by_unit.entry((*kind, *unit)).or_default().push(id);
        }
        for (&(kind, unit), list) in &by_unit {
            for (x, &ia) in list.iter().enumerate() {
                for &ib in &list[x + 1..] {
                    let ga = &id_list[ia].0 .3;
                    let gb = &id_list[ib].0 .3;
                    let mut reference: Option<(usize, Vec<usize>)> = None;
                    for &g in ga.iter().filter(|g| gb.binary_search(g).is_ok()) {
                        if g >= self.bound {
                            continue;
                        }
                        let Some(seq) = seqs.get(&(kind, unit, g)) else {
                            continue;
                        };
                        let filtered: Vec<(usize, usize)> = seq
                            .iter()
                            .copied()
                            .filter(|&(id, _)| id == ia || id == ib)
                            .collect();
                        let order: Vec<usize> = filtered.iter().map(|x| x.0).collect();
                        match &reference {
                            None => reference = Some((g, order)),
                            Some((rg, rorder)) => {
                                if let Some(d) = order.iter().zip(rorder).position(|(a, b)| a != b)
                                {
                                    let (ra, rb) = (&id_list[ia], &id_list[ib]);
                                    let (a_txt, b_txt) =
                                        (&p.programs[ra.1][ra.2], &p.programs[rb.1][rb.2]);
                                    let msg = format!(
                                        "rank {g} lists `{a_txt}` and `{b_txt}` in a different \
                                         order than rank {rg}: collectives of one kind on one \
                                         unit must appear in the same relative order on every \
                                         member; reorder rank {g}'s list"
                                    );
                                    let i = filtered[d].1;
                                    self.at(Rule::Parameters, g, i, msg);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    // -- rule 5 ------------------------------------------------------------

    fn termination(&mut self, mode: Mode) {
        let opts = SimOptions { mode, comm: None };
        let mode_name = match mode {
            Mode::Rendezvous => "rendezvous",
            Mode::Eager => "eager",
        };
        match simulate(self.p, &opts) {
            Ok(_) => {}
            Err(SimError::Deadlock { blocked }) => {
                for b in blocked {
                    self.at(
                        Rule::Termination,
                        b.rank,
                        b.index,
                        format_args!(
                            "never completes under {mode_name} semantics (deadlock): waits \
                             for {}; reorder so both sides meet, or post crossing transfers \
                             in one batch",
                            b.waiting_for
                        ),
                    );
                }
            }
            Err(e) => self.push(
                Rule::Termination,
                None,
                None,
                format!(
                    "not checked, because the program cannot be executed: {e} \
                     (fix the violations above first)"
                ),
            ),
        }
    }
}

/// Rule 1's count of one `(unit, mb)`: per op kind (F, B, W, BW), how many
/// (saturating) and where the first one is (rank, index).
#[derive(Clone, Copy)]
struct Tally {
    count: [u8; 4],
    first: [(u32, u32); 4],
}

impl Tally {
    const EMPTY: Tally = Tally {
        count: [0; 4],
        first: [(NONE, NONE); 4],
    };
}

/// Rule 3's batches on one rank: per peer and direction (`peer * 2 + [SEND, RECV]`),
/// the serial number of the last batch holding a `SEND` to it (a `RECV` from it)
/// and where that one is.
struct Stamps {
    last: Vec<(usize, usize)>,
}

impl Stamps {
    /// Transfer `(i, dir, peer)` of rank `r` in batch `serial`: a second one in one
    /// direction with one peer is a violation (into `found`).
    #[inline(always)]
    fn stamp(
        &mut self,
        r: usize,
        (i, dir, peer): (usize, Dir, usize),
        serial: usize,
        found: &mut Vec<(usize, usize, String)>,
    ) {
        let last = &mut self.last[peer * 2 + usize::from(dir == Dir::Recv)];
        if last.0 == serial {
            let (what, prep) = match dir {
                Dir::Send => ("SEND", "to"),
                Dir::Recv => ("RECV", "from"),
            };
            found.push((
                r,
                i,
                format!(
                    "this batch already holds a {what} {prep} rank {peer} (action {}): a batch \
                     allows one buffer per direction per peer; move one into another batch",
                    last.1
                ),
            ));
        } else {
            *last = (serial, i);
        }
    }
}

/// Rule 3's channels: `(from, to)` with its sends' and receives' keys.
///
/// The pass keeps the keys of the side listed by the rank it reaches first
/// (`min(from, to)`), in list order, and compares the other side's with them key by
/// key as it reads them. A channel whose two sides differ (none in a valid program)
/// is marked `apart` and has both sides read again after the pass
/// ([`Checker::reread`]).
struct Chan {
    ends: (usize, usize),
    /// The first side's keys.
    keys: Vec<u32>,
    /// How many of them the other side has listed so far, in the same order.
    next: usize,
    apart: bool,
    /// Both sides (sends, receives), read again: only for a channel `apart`.
    sides: Option<(Vec<u32>, Vec<u32>)>,
}

impl Chan {
    fn new(ends: (usize, usize)) -> Chan {
        Chan {
            ends,
            keys: Vec::new(),
            next: 0,
            apart: false,
            sides: None,
        }
    }

    /// The transfer of `key` as the pass reads it, on the side the pass reaches
    /// first (`first`) or on the other one.
    #[inline(always)]
    fn read(&mut self, first: bool, key: u32) {
        if first {
            self.keys.push(key);
        } else if self.keys.get(self.next) == Some(&key) {
            self.next += 1;
        } else {
            self.apart = true;
        }
    }

    /// Both sides, sends first: the kept keys twice where they agree.
    fn sides(&self) -> (&[u32], &[u32]) {
        match &self.sides {
            Some((s, r)) => (s, r),
            None => (&self.keys, &self.keys),
        }
    }
}

/// The place of channel `ends` in `chans`, added if new: found in `table` (ranks x
/// ranks cells, `nr` a row) where it is not empty, else in `map`.
fn channel(
    chans: &mut Vec<Chan>,
    table: &mut [u32],
    map: &mut BTreeMap<(usize, usize), usize>,
    nr: usize,
    ends: (usize, usize),
) -> usize {
    // Both ends are below `nr`: the pass keeps a transfer only when its peer exists.
    let cell = (!table.is_empty()).then(|| ends.0 * nr + ends.1);
    match cell {
        Some(c) if table[c] != NONE => table[c] as usize,
        Some(c) => {
            table[c] = chans.len() as u32;
            chans.push(Chan::new(ends));
            chans.len() - 1
        }
        None => *map.entry(ends).or_insert_with(|| {
            chans.push(Chan::new(ends));
            chans.len() - 1
        }),
    }
}

/// Mark the members of one longest strictly increasing subsequence of `xs`
/// (patience sorting, `O(n log n)`; among equal lengths, the one ending earliest).
fn longest_increasing(xs: &[u32]) -> Vec<bool> {
    let mut tails: Vec<usize> = Vec::new(); // index into xs of the tail of each length
    let mut prev = vec![usize::MAX; xs.len()];
    for (i, &x) in xs.iter().enumerate() {
        let len = tails.partition_point(|&t| xs[t] < x);
        if len > 0 {
            prev[i] = tails[len - 1];
        }
        if len == tails.len() {
            tails.push(i);
        } else {
            tails[len] = i;
        }
    }
    let mut keep = vec![false; xs.len()];
    let mut at = tails.last().copied().unwrap_or(usize::MAX);
    while at != usize::MAX {
        keep[at] = true;
        at = prev[at];
    }
    keep
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::program::{Action, Unit};
    use crate::judge::simulate::tests::{acts, prog, unit};

    fn u(name: &str, inputs: &[&str], home: usize) -> Unit {
        unit(name, inputs, home, 1.0, 1.0, 1.0, 1.0)
    }

    fn frozen(mut x: Unit) -> Unit {
        x.trainable = false;
        x
    }

    /// A valid two-rank GPipe program: `a` on rank 0 feeds `b` on rank 1.
    fn base_lists() -> [&'static str; 2] {
        [
            "F a 0; SEND act a 0 1; F a 1; SEND act a 1 1; \
             RECV grad b 0 1; B a 0; W a 0; RECV grad b 1 1; B a 1; W a 1",
            "RECV act a 0 0; F b 0; RECV act a 1 0; F b 1; \
             B b 0; SEND grad b 0 0; W b 0; B b 1; SEND grad b 1 0; W b 1",
        ]
    }

    fn base_with(lists: [&str; 2]) -> Program {
        prog(2, vec![u("a", &[], 0), u("b", &["a"], 1)], &lists)
    }

    fn base() -> Program {
        base_with(base_lists())
    }

    /// Is there a violation of `rule` at `rank`/`index` whose message contains `text`?
    #[track_caller]
    fn has(vs: &[Violation], rule: Rule, rank: Option<usize>, index: Option<usize>, text: &str) {
        assert!(
            vs.iter().any(|v| v.rule == rule
                && v.rank == rank
                && v.index == index
                && v.message.contains(text)),
            "no {rule} at {rank:?}/{index:?} containing {text:?} in:\n{}",
            vs.iter().map(|v| format!("  {v}\n")).collect::<String>()
        );
    }

    fn rules(vs: &[Violation]) -> Vec<u8> {
        vs.iter().map(|v| v.rule.number()).collect()
    }

    #[test]
    fn valid_program_has_no_violations() {
        assert_eq!(verify(&base()), vec![]);
        assert_eq!(verify_mode(&base(), Mode::Eager), vec![]);
    }

    #[test]
    fn frozen_encoder_needs_no_backward() {
        let p = prog(
            1,
            vec![frozen(u("enc", &[], 0)), u("llm", &["enc"], 0)],
            &["F enc 0; F llm 0; B llm 0; W llm 0"],
        );
        assert_eq!(verify(&p), vec![]);
        // A frozen unit fed by a trainable one needs backward (of its inputs).
        let q = prog(
            1,
            vec![u("a", &[], 0), frozen(u("f", &["a"], 0))],
            &["F a 0; F f 0; B a 0; W a 0"],
        );
        let vs = verify(&q);
        has(&vs, Rule::Coverage, None, None, "no B(f,0) or BW(f,0)");
        has(&vs, Rule::LocalData, Some(0), Some(2), "reads grad(f,0)");
    }

    #[test]
    fn display_and_order() {
        assert_eq!(Rule::LocalData.to_string(), "rule 2 (local data)");
        assert_eq!(Rule::Termination.number(), 5);
        let mut lists = base_lists();
        lists[1] = "F b 0; RECV act a 0 0; RECV act a 1 0; F b 1; \
                    B b 0; SEND grad b 0 0; W b 0; B b 1; SEND grad b 1 0; W b 1";
        let vs = verify(&base_with(lists));
        assert_eq!(vs.len(), 1, "{vs:?}");
        assert_eq!(
            vs[0].to_string(),
            "rule 2 (local data): rank 1, action 0 `F(b,0)`: reads act(a,0), but no F(a,0), \
             RF(a,0) or RECV act(a,0) comes earlier on rank 1: add one before it"
        );
        let v = Violation {
            rule: Rule::Parameters,
            rank: Some(2),
            index: None,
            message: "m".into(),
        };
        assert_eq!(v.to_string(), "rule 4 (parameters): rank 2: m");
        // Sorted by rule, then rank, then index.
        let mut p = base();
        p.format = "x".into();
        p.programs[1].remove(0);
        let vs = verify(&p);
        let keys: Vec<_> = vs.iter().map(|v| (v.rule, v.rank, v.index)).collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(keys, sorted);
        assert_eq!(vs[0].rule, Rule::Coverage);
    }

    #[test]
    fn header_and_unit_problems() {
        let mut p = base();
        p.format = "mpipe-program/0".into();
        p.ranks = 3;
        p.units[0].home = 7;
        p.units[1].cost.f = -1.0;
        let vs = verify(&p);
        has(
            &vs,
            Rule::Coverage,
            None,
            None,
            "`format` is \"mpipe-program/0\"",
        );
        has(
            &vs,
            Rule::Coverage,
            None,
            None,
            "`ranks` is 3 but `programs` holds 2",
        );
        has(&vs, Rule::Parameters, None, None, "home rank 7");
        has(&vs, Rule::Termination, None, None, "`cost.F` is -1");
        has(&vs, Rule::Termination, None, None, "not checked");

        let mut q = prog(
            1,
            vec![u("b", &["a", "zz"], 0), u("a", &[], 0), u("a", &[], 0)],
            &[""],
        );
        q.units[0].inputs.push("b".into());
        let vs = verify(&q);
        has(&vs, Rule::Coverage, None, None, "unit `a` is defined twice");
        has(
            &vs,
            Rule::LocalData,
            None,
            None,
            "reads input `zz`, which is not a unit",
        );
        has(
            &vs,
            Rule::LocalData,
            None,
            None,
            "reads input `a`, which is not defined before it",
        );
        has(
            &vs,
            Rule::LocalData,
            None,
            None,
            "reads input `b`, which is not defined before it",
        );
    }

    #[test]
    fn rule1_coverage() {
        let one = |lists: &[&str], units: Vec<Unit>| verify(&prog(1, units, lists));
        let a = || vec![u("a", &[], 0)];
        // Missing F and backward.
        let vs = one(&[""], a());
        has(&vs, Rule::Coverage, None, None, "no F(a,0) anywhere");
        has(&vs, Rule::Coverage, None, None, "no B(a,0) or BW(a,0)");
        // Duplicate F, reported at the second.
        let vs = one(&["F a 0; BW a 0; F a 0"], a());
        has(
            &vs,
            Rule::Coverage,
            Some(0),
            Some(2),
            "another F(a,0) (the first is rank 0, action 0)",
        );
        // B and BW both.
        let vs = one(&["F a 0; B a 0; W a 0; BW a 0"], a());
        has(
            &vs,
            Rule::Coverage,
            Some(0),
            Some(3),
            "use either B (with W) or BW",
        );
        // Missing W after B.
        let vs = one(&["F a 0; B a 0"], a());
        has(&vs, Rule::Coverage, Some(0), Some(1), "no W(a,0)");
        // W on another rank than B.
        let vs = verify(&prog(1, a(), &["F a 0; B a 0", "W a 0"]));
        has(
            &vs,
            Rule::Coverage,
            Some(1),
            Some(0),
            "move the W to rank 0",
        );
        // W with a fused BW.
        let vs = one(&["F a 0; BW a 0; W a 0"], a());
        has(
            &vs,
            Rule::Coverage,
            Some(0),
            Some(2),
            "a fused BW already includes W",
        );
        // W or B of a frozen unit with no trainable input.
        let vs = one(&["F a 0; W a 0"], vec![frozen(u("a", &[], 0))]);
        has(&vs, Rule::Coverage, Some(0), Some(1), "W of a frozen unit");
        let vs = one(&["F a 0; B a 0"], vec![frozen(u("a", &[], 0))]);
        has(&vs, Rule::Coverage, Some(0), Some(1), "needs no backward");
        // Unknown unit and micro-batch out of range.
        let vs = one(&["F a 0; BW a 0; F nope 0; F a 4"], a());
        has(
            &vs,
            Rule::Coverage,
            Some(0),
            Some(2),
            "no unit is called `nope`",
        );
        has(
            &vs,
            Rule::Coverage,
            Some(0),
            Some(3),
            "micro-batch 4 does not exist",
        );
        // RF is always allowed.
        assert_eq!(one(&["F a 0; RF a 0; RF a 0; BW a 0"], a()), vec![]);
    }

    #[test]
    fn rule2_local_data() {
        // B without its forward, W before B.
        let vs = verify(&prog(1, vec![u("a", &[], 0)], &["B a 0; F a 0; W a 0"]));
        has(
            &vs,
            Rule::LocalData,
            Some(0),
            Some(0),
            "needs the activations of F(a,0)",
        );
        let vs = verify(&prog(1, vec![u("a", &[], 0)], &["F a 0; W a 0; B a 0"]));
        has(
            &vs,
            Rule::LocalData,
            Some(0),
            Some(1),
            "needs B(a,0) earlier on rank 0",
        );
        // B of `a` without the gradient of its successor.
        let mut lists = base_lists();
        lists[0] = "F a 0; SEND act a 0 1; F a 1; SEND act a 1 1; \
                    B a 0; RECV grad b 0 1; W a 0; RECV grad b 1 1; B a 1; W a 1";
        let vs = verify(&base_with(lists));
        has(&vs, Rule::LocalData, Some(0), Some(4), "reads grad(b,0)");
        // RF satisfies B's forward; RF needs its inputs too.
        let p = prog(
            1,
            vec![u("a", &[], 0), u("b", &["a"], 0)],
            &["F a 0; F b 0; RF b 0; BW b 0; BW a 0", "RF b 0"],
        );
        let vs = verify(&p);
        has(&vs, Rule::LocalData, Some(1), Some(0), "reads act(a,0)");
        assert!(vs.iter().all(|v| v.rank != Some(0)), "{vs:?}");
    }

    #[test]
    fn rule3_matching() {
        // A SEND without RECV and a RECV without SEND.
        let mut lists = base_lists();
        lists[1] = "RECV act a 0 0; F b 0; RECV act a 9 0; F b 1; \
                    B b 0; SEND grad b 0 0; W b 0; B b 1; SEND grad b 1 0; W b 1";
        let mut p = base_with(lists);
        p.microbatches = 10;
        let vs = verify(&p);
        has(
            &vs,
            Rule::Matching,
            Some(0),
            Some(3),
            "no matching `RECV act(a,1)<-0` on rank 1",
        );
        has(
            &vs,
            Rule::Matching,
            Some(1),
            Some(2),
            "no matching `SEND act(a,9)->1` on rank 0",
        );
        // Sends in another order than receives: only the moved one is reported.
        let mut lists = base_lists();
        lists[0] = "F a 0; F a 1; SEND act a 1 1; SEND act a 0 1; \
                    RECV grad b 0 1; B a 0; W a 0; RECV grad b 1 1; B a 1; W a 1";
        let vs = verify(&base_with(lists));
        let order: Vec<_> = vs.iter().filter(|v| v.rule == Rule::Matching).collect();
        assert_eq!(order.len(), 1, "{vs:?}");
        has(&vs, Rule::Matching, Some(0), Some(2), "different order");
        has(&vs, Rule::Termination, Some(0), Some(2), "deadlock");
        // SEND before the producer.
        let mut lists = base_lists();
        lists[0] = "SEND act a 0 1; F a 0; F a 1; SEND act a 1 1; \
                    RECV grad b 0 1; B a 0; W a 0; RECV grad b 1 1; B a 1; W a 1";
        let vs = verify(&base_with(lists));
        has(
            &vs,
            Rule::Matching,
            Some(0),
            Some(0),
            "before rank 0 produces it",
        );
        let mut lists = base_lists();
        lists[1] = "RECV act a 0 0; F b 0; RECV act a 1 0; F b 1; \
                    SEND grad b 0 0; B b 0; W b 0; B b 1; SEND grad b 1 0; W b 1";
        let vs = verify(&base_with(lists));
        has(
            &vs,
            Rule::Matching,
            Some(1),
            Some(4),
            "put it after B(b,0) or BW(b,0)",
        );
        // Duplicate transfers, self and missing peers, input of a unit with inputs.
        let p = prog(
            1,
            vec![u("a", &[], 0), u("b", &["a"], 1)],
            &[
                "F a 0; SEND act a 0 1; SEND act a 0 1; SEND act a 0 0; SEND act a 0 5; \
                 SEND input b 0 1",
                "RECV act a 0 0; RECV act a 0 0; RECV input b 0 0; F b 0; BW b 0",
            ],
        );
        let vs = verify(&p);
        has(
            &vs,
            Rule::Matching,
            Some(0),
            Some(2),
            "already sends act(a,0) to rank 1",
        );
        has(
            &vs,
            Rule::Matching,
            Some(1),
            Some(1),
            "already receives act(a,0) from rank 0",
        );
        has(
            &vs,
            Rule::Matching,
            Some(0),
            Some(3),
            "the peer is this rank itself",
        );
        has(
            &vs,
            Rule::Matching,
            Some(0),
            Some(4),
            "rank 5 does not exist",
        );
        has(&vs, Rule::Matching, Some(0), Some(5), "`b` has inputs");
        has(&vs, Rule::Matching, Some(1), Some(2), "`b` has inputs");
        // Two SENDs to one peer in a batch; a SEND and a RECV with one peer are fine.
        let p = prog(
            2,
            vec![u("a", &[], 0), u("b", &["a"], 1)],
            &[
                "F a 0; F a 1; SEND act a 0 1 4; SEND act a 1 1 4; RECV grad b 0 1 4",
                "RECV act a 0 0 2; RECV act a 1 0 2; SEND grad b 0 0 2",
            ],
        );
        let vs = verify(&p);
        has(
            &vs,
            Rule::Matching,
            Some(0),
            Some(3),
            "this batch already holds a SEND to rank 1",
        );
        has(
            &vs,
            Rule::Matching,
            Some(1),
            Some(1),
            "this batch already holds a RECV from rank 0",
        );
        assert_eq!(
            vs.iter()
                .filter(|v| v.message.contains("this batch already"))
                .count(),
            2
        );
    }

    fn enc_lists() -> [&'static str; 2] {
        [
            "BCAST enc 0 0,1; F enc 0; SEND act enc 0 1; RECV grad llm 0 1; B enc 0; W enc 0; \
             REDUCE enc 0 0,1",
            "BCAST enc 0 0,1; RECV act enc 0 0; F llm 0; F enc 1; F llm 1; B llm 0; \
             SEND grad llm 0 0; W llm 0; B llm 1; W llm 1; B enc 1; W enc 1; REDUCE enc 0 0,1",
        ]
    }

    fn enc(lists: [&str; 2]) -> Program {
        prog(2, vec![u("enc", &[], 0), u("llm", &["enc"], 1)], &lists)
    }

    #[test]
    fn rule4_parameters() {
        assert_eq!(verify(&enc(enc_lists())), vec![]);
        // No BCAST on rank 1: rank 1 computes enc unbroadcast, and is missing from a group.
        let mut l = enc_lists();
        l[1] = "RECV act enc 0 0; F llm 0; F enc 1; F llm 1; B llm 0; \
                SEND grad llm 0 0; W llm 0; B llm 1; W llm 1; B enc 1; W enc 1; REDUCE enc 0 0,1";
        let vs = verify(&enc(l));
        has(
            &vs,
            Rule::Parameters,
            Some(1),
            Some(2),
            "takes part in no BCAST(enc) before this",
        );
        has(
            &vs,
            Rule::Parameters,
            Some(1),
            None,
            "rank 1 lists it 0 time(s)",
        );
        has(&vs, Rule::Termination, Some(0), Some(0), "deadlock");
        // BCAST after the first compute.
        let mut l = enc_lists();
        l[1] = "RECV act enc 0 0; F llm 0; F enc 1; BCAST enc 0 0,1; F llm 1; B llm 0; \
                SEND grad llm 0 0; W llm 0; B llm 1; W llm 1; B enc 1; W enc 1; REDUCE enc 0 0,1";
        has(
            &verify(&enc(l)),
            Rule::Parameters,
            Some(1),
            Some(2),
            "no BCAST(enc) before",
        );
        // REDUCE before the last W, and no REDUCE at all.
        let mut l = enc_lists();
        l[1] = "BCAST enc 0 0,1; RECV act enc 0 0; F llm 0; F enc 1; F llm 1; B llm 0; \
                SEND grad llm 0 0; W llm 0; B llm 1; W llm 1; B enc 1; REDUCE enc 0 0,1; W enc 1";
        has(
            &verify(&enc(l)),
            Rule::Parameters,
            Some(1),
            Some(12),
            "no REDUCE(enc) after",
        );
        let mut l = enc_lists();
        l[1] = "BCAST enc 0 0,1; RECV act enc 0 0; F llm 0; F enc 1; F llm 1; B llm 0; \
                SEND grad llm 0 0; W llm 0; B llm 1; W llm 1; B enc 1; W enc 1";
        let vs = verify(&enc(l));
        has(
            &vs,
            Rule::Parameters,
            Some(1),
            Some(11),
            "no REDUCE(enc) after",
        );
        has(
            &vs,
            Rule::Parameters,
            Some(1),
            None,
            "`REDUCE(enc, root 0, group [0, 1])`",
        );
        // Collectives of one kind and unit in different orders on two members.
        let p = prog(
            1,
            vec![u("a", &[], 0)],
            &[
                "F a 0; BW a 0; BCAST a 0 0,1; BCAST a 1 0,1",
                "BCAST a 1 0,1; BCAST a 0 0,1",
            ],
        );
        let vs = verify(&p);
        has(
            &vs,
            Rule::Parameters,
            Some(1),
            Some(0),
            "in a different order than rank 0",
        );
        // Malformed collectives.
        let p = prog(
            1,
            vec![u("a", &[], 0)],
            &["F a 0; BW a 0; BCAST a 1 0; BCAST a 0 0,0,1; REDUCE a 9 0,7; BCAST a 0 1; REDUCE q 0 0,1", "BCAST a 0 0,1"],
        );
        let vs = verify(&p);
        has(
            &vs,
            Rule::Parameters,
            Some(0),
            Some(2),
            "root 1 is not in the group",
        );
        has(
            &vs,
            Rule::Parameters,
            Some(0),
            Some(3),
            "rank 0 appears twice",
        );
        has(
            &vs,
            Rule::Parameters,
            Some(0),
            Some(4),
            "root 9 does not exist",
        );
        has(
            &vs,
            Rule::Parameters,
            Some(0),
            Some(4),
            "group member 7 does not exist",
        );
        has(
            &vs,
            Rule::Parameters,
            Some(0),
            Some(5),
            "rank 0 lists this collective but is not in its group",
        );
        has(
            &vs,
            Rule::Parameters,
            Some(0),
            Some(6),
            "no unit is called `q`",
        );
    }

    /// Both ranks SEND first with no batch: a deadlock under rendezvous only.
    #[test]
    fn rule5_deadlock_rendezvous_not_eager() {
        let mut lists = base_lists();
        lists[1] = "RECV act a 0 0; F b 0; B b 0; SEND grad b 0 0; W b 0; \
                    RECV act a 1 0; F b 1; B b 1; SEND grad b 1 0; W b 1";
        let p = base_with(lists);
        let vs = verify(&p);
        assert_eq!(rules(&vs), vec![5, 5], "{vs:?}");
        has(
            &vs,
            Rule::Termination,
            Some(0),
            Some(3),
            "waits for RECV act(a,1)<-0 (rank 1, action 5)",
        );
        has(
            &vs,
            Rule::Termination,
            Some(1),
            Some(3),
            "stuck at action 3 `SEND act(a,1)->1`",
        );
        assert_eq!(verify_mode(&p, Mode::Eager), vec![]);
    }

    #[test]
    fn absurd_microbatch_count() {
        let mut p = base();
        p.microbatches = usize::MAX / 2;
        let vs = verify(&p);
        has(&vs, Rule::Coverage, None, None, "check `microbatches`");
        let mut p = base();
        p.microbatches = 1 << 20;
        let vs = verify(&p);
        has(&vs, Rule::Coverage, None, None, "check `microbatches`");
    }

    mod nonsense {
        use super::*;
        use proptest::prelude::*;

        fn action() -> impl Strategy<Value = Action> {
            let name = prop::sample::select(vec!["a", "b", "c", "zz"]);
            let t = prop::sample::select(vec![Tensor::Act, Tensor::Grad, Tensor::Input]);
            prop_oneof![
                (0..5usize, name.clone(), 0..4usize).prop_map(|(k, n, mb)| {
                    let op = [Op::F, Op::B, Op::W, Op::BW, Op::RF][k];
                    Action::compute(op, n, mb)
                }),
                (
                    any::<bool>(),
                    t,
                    name.clone(),
                    0..4usize,
                    0..5usize,
                    prop::option::of(0..3u64)
                )
                    .prop_map(|(s, t, n, mb, peer, b)| {
                        let dir = if s { Dir::Send } else { Dir::Recv };
                        Action::p2p(dir, t, n, mb, peer, b)
                    }),
                (
                    any::<bool>(),
                    name,
                    0..5usize,
                    prop::collection::vec(0..5usize, 0..4)
                )
                    .prop_map(|(bc, n, root, group)| {
                        let kind = if bc {
                            CollKind::Bcast
                        } else {
                            CollKind::Reduce
                        };
                        Action::coll(kind, n.to_string(), root, group)
                    }),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(300))]
            /// Arbitrary nonsense never panics, and rule 5 agrees with the simulator.
            #[test]
            fn never_panics(
                lists in prop::collection::vec(prop::collection::vec(action(), 0..12), 0..4),
                ranks in 0..5usize,
                microbatches in 0..4usize,
                frozen_a in any::<bool>(),
            ) {
                let mut units = vec![u("a", &[], 0), u("b", &["a"], 1), u("c", &["a", "b"], 3)];
                units[0].trainable = !frozen_a;
                let p = Program {
                    format: crate::ir::program::FORMAT.into(),
                    ranks,
                    microbatches,
                    units,
                    programs: lists,
                    source: None,
                    prefetch: Vec::new(),
                };
                for mode in [Mode::Rendezvous, Mode::Eager] {
                    let vs = verify_mode(&p, mode);
                    let sim = simulate(&p, &SimOptions { mode, comm: None });
                    let deadlocked = vs.iter().any(|v| v.rule == Rule::Termination
                        && v.message.contains("deadlock"));
                    prop_assert_eq!(deadlocked, matches!(sim, Err(SimError::Deadlock { .. })));
                    for v in &vs {
                        let _ = v.to_string();
                    }
                }
            }
        }
    }

    /// A trainable and a frozen encoder and an LLM, for derived programs.
    const PROFILE: &str = r#"
[[encoder]]
name = "vision"
layers = 2
forward = 1.0
backward = 1.0
weight = 0.5
activation = 0.2
params = 1.0
trainable = true

[[encoder]]
name = "audio"
layers = 2
forward = 0.5
backward = 0.5
activation = 0.1
trainable = false

[llm]
layers = 12
forward = 1.0
backward = 1.0
weight = 1.0
activation = 1.0
params = 0.5
"#;

    /// Every mutant of `p` with one action dropped, duplicated, swapped with the
    /// next one, or (a transfer) given the next peer.
    fn mutants(p: &Program) -> Vec<Program> {
        let mut out = Vec::new();
        for r in 0..p.programs.len() {
            for i in 0..p.programs[r].len() {
                let mut q = p.clone();
                q.programs[r].remove(i);
                out.push(q);
                let mut q = p.clone();
                let a = q.programs[r][i].clone();
                q.programs[r].insert(i, a);
                out.push(q);
                if i + 1 < p.programs[r].len() {
                    let mut q = p.clone();
                    q.programs[r].swap(i, i + 1);
                    out.push(q);
                }
                if let ActionRef::P2p(t) = p.programs[r][i].view() {
                    let mut q = p.clone();
                    let peer = (t.peer + 1) % p.ranks;
                    q.programs[r][i] = Action::p2p(t.dir, t.tensor, t.unit, t.mb, peer, t.batch);
                    out.push(q);
                }
            }
        }
        out
    }

    /// The pass's shortcuts (actions read straight from the list, each channel's
    /// second side compared with its first as it is read) report exactly what the
    /// full reading does: the same violations in the same order, on valid derived
    /// programs and on every mutant of them with one action dropped, duplicated,
    /// swapped or re-peered.
    #[test]
    fn shortcuts_report_what_the_full_reading_does() {
        use crate::algebra::profile::Profile;
        use crate::search::derive::{derive_str, Request};
        let profile = Profile::from_toml_str(PROFILE).unwrap();
        let req = Request::new(&profile, 3, 6);
        let mut invalid = 0;
        for expr in [
            "1f1b",
            "zbv",
            "transpose(vision, zbv)",
            "transpose(vision, 1f1b, backward = central)",
        ] {
            let p = derive_str(&req, expr).unwrap().program;
            assert!(
                check(&p, None).is_empty(),
                "{expr}: derived programs are valid"
            );
            assert!(check_as(&p, None, true).is_empty(), "{expr}");
            for q in mutants(&p) {
                let fast = check(&q, None);
                assert_eq!(fast, check_as(&q, None, true), "{expr}");
                invalid += usize::from(!fast.is_empty());
            }
        }
        assert!(invalid > 0, "the mutants break rules");
    }

    #[test]
    fn acts_helper_round_trip() {
        assert_eq!(acts("F a 0")[0].to_string(), "F(a,0)");
    }
}
