//! A collective's identity, as the engine ([`crate::judge::simulate`]) matches
//! its occurrences and a resumed run ([`crate::judge::resume`]) finds them: its
//! kind, unit, root and the set of its group's members (sorted, each once). The
//! `k`-th occurrence of an identity on a rank meets the `k`-th on every other
//! member; both readers intern identities here, so they cannot disagree on
//! which collectives are one.

use std::collections::BTreeMap;

use crate::ir::program::CollKind;

/// A collective's identity: kind, unit, root, sorted distinct group members.
pub(crate) type CollId = (CollKind, u32, usize, Vec<usize>);

/// Identities numbered in first-seen order.
#[derive(Debug, Default)]
pub(crate) struct CollIds {
    id_of: BTreeMap<CollId, u32>,
    ids: Vec<CollId>,
}

impl CollIds {
    /// The number of the identity of a collective of `kind` on `unit` rooted at
    /// `root` over `group` (members in any order, repeats allowed), numbered
    /// next if it is new.
    pub(crate) fn intern(
        &mut self,
        kind: CollKind,
        unit: u32,
        root: usize,
        group: &[usize],
    ) -> u32 {
        let mut group = group.to_vec();
        group.sort_unstable();
        group.dedup();
        let key: CollId = (kind, unit, root, group);
        match self.id_of.get(&key) {
            Some(&id) => id,
            None => {
                let id = self.ids.len() as u32;
                self.ids.push(key.clone());
                self.id_of.insert(key, id);
                id
            }
        }
    }

    /// The identities, by number.
    pub(crate) fn into_ids(self) -> Vec<CollId> {
        self.ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Two collectives get one number exactly when kind, unit, root and the
        /// set of members agree; numbers follow first appearance.
        #[test]
        fn one_number_per_identity(
            colls in proptest::collection::vec(
                (0u8..2, 0u32..3, 0usize..3, proptest::collection::vec(0usize..4, 0..5)),
                0..12,
            ),
        ) {
            let mut ids = CollIds::default();
            let kind = |k: u8| [CollKind::Bcast, CollKind::Reduce][k as usize];
            let got: Vec<u32> = colls
                .iter()
                .map(|(k, u, r, g)| ids.intern(kind(*k), *u, *r, g))
                .collect();
            let set = |g: &[usize]| g.iter().copied().collect::<std::collections::BTreeSet<_>>();
            for (a, x) in colls.iter().enumerate() {
                for (b, y) in colls.iter().enumerate() {
                    let same = x.0 == y.0 && x.1 == y.1 && x.2 == y.2 && set(&x.3) == set(&y.3);
                    proptest::prop_assert_eq!(got[a] == got[b], same);
                }
                let first = got[..a].iter().copied().max().map_or(0, |m| m + 1);
                proptest::prop_assert!(got[a] <= first);
            }
            let ids = ids.into_ids();
            proptest::prop_assert_eq!(ids.len(), got.iter().copied().max().map_or(0, |m| m as usize + 1));
            for (id, g) in ids.iter().map(|i| &i.3).enumerate() {
                proptest::prop_assert!(g.windows(2).all(|w| w[0] < w[1]), "{id}: {g:?}");
            }
        }
    }
}
