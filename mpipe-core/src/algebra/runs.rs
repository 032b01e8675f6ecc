//! A stable sort for lists that are a few sorted runs: the lowering sorts lists
//! built in an order close to the one sought (a rank's transfer ends grouped by
//! peer, each group rising with the micro-batch), whose runs are long but too
//! short (tens of items) for the standard library's sort to merge rather than
//! sort again.
//!
//! [`sort_runs`] finds the list's maximal non-descending runs in one pass and
//! merges neighbouring runs, level by level, each level one pass over the list:
//! the list's length times one more than the logarithm of its number of runs
//! (linear for a list of a few runs). A merge takes from the left run on a tie,
//! so equal keys keep their order: the order of a stable sort by the same key,
//! item for item.

/// `list` sorted stably by `key` (as `sort_by_key` sorts it), by merging its
/// non-descending runs; `buffer` and `bounds` are the caller's scratch, kept across
/// calls.
pub(crate) fn sort_runs<T: Copy, K: Ord>(
    list: &mut [T],
    buffer: &mut Vec<T>,
    bounds: &mut Vec<usize>,
    key: impl Fn(&T) -> K,
) {
    if merge_runs(list, buffer, bounds, key) {
        list.copy_from_slice(&buffer[..list.len()]);
    }
}

/// [`sort_runs`]' order of `list`, left where the last merge wrote it (in `list`
/// or at the start of `buffer`) rather than copied back: for a caller that only
/// reads it.
pub(crate) fn sorted_runs<'a, T: Copy, K: Ord>(
    list: &'a mut [T],
    buffer: &'a mut Vec<T>,
    bounds: &mut Vec<usize>,
    key: impl Fn(&T) -> K,
) -> &'a [T] {
    let n = list.len();
    if merge_runs(list, buffer, bounds, key) {
        &buffer[..n]
    } else {
        list
    }
}

/// `list`'s runs merged by `key`, level by level, between `list` and `buffer`;
/// whether the sorted list ends in `buffer` (its first `list.len()` items; else in
/// `list`).
fn merge_runs<T: Copy, K: Ord>(
    list: &mut [T],
    buffer: &mut Vec<T>,
    bounds: &mut Vec<usize>,
    key: impl Fn(&T) -> K,
) -> bool {
    let n = list.len();
    // Where each run begins, then the end of the list.
    bounds.clear();
    bounds.push(0);
    let Some(&first) = list.first() else {
        return false;
    };
    let mut last = key(&first);
    for (i, x) in list.iter().enumerate().skip(1) {
        let k = key(x);
        if k < last {
            bounds.push(i);
        }
        last = k;
    }
    bounds.push(n);
    if bounds.len() <= 2 {
        return false;
    }
    // Room for the list, filled only where the scratch has less (every place is
    // written before it is read).
    if buffer.len() < n {
        buffer.resize(n, first);
    }
    let buffer = &mut buffer[..n];
    // Whether the runs of this level are in `list` (else in `buffer`).
    let mut in_list = true;
    while bounds.len() > 2 {
        let (from, to): (&[T], &mut [T]) = if in_list {
            (list, buffer)
        } else {
            (buffer, list)
        };
        let runs = bounds.len() - 1;
        // Runs `2w` and `2w + 1` become run `w` of the next level (a last run
        // without a neighbour is copied); its bound is written where the bounds
        // already read were.
        let mut w = 0;
        for k in (0..runs).step_by(2) {
            let lo = bounds[k];
            if k + 1 < runs {
                let (mid, hi) = (bounds[k + 1], bounds[k + 2]);
                merge(&from[lo..hi], mid - lo, &mut to[lo..hi], &key);
            } else {
                let hi = bounds[k + 1];
                to[lo..hi].copy_from_slice(&from[lo..hi]);
            }
            bounds[w] = lo;
            w += 1;
        }
        bounds[w] = n;
        bounds.truncate(w + 1);
        in_list = !in_list;
    }
    !in_list
}

/// The sorted runs `from[..mid]` and `from[mid..]` merged into `to` (as long as
/// `from`), the left one's item first on a tie. Each run's next item and its key
/// are held while the other run's items go out.
fn merge<T: Copy, K: Ord>(from: &[T], mid: usize, to: &mut [T], key: &impl Fn(&T) -> K) {
    let (left, right) = from.split_at(mid);
    let (Some(&a), Some(&b)) = (left.first(), right.first()) else {
        to.copy_from_slice(from);
        return;
    };
    let (mut i, mut j, mut o) = (0, 0, 0);
    let (mut a, mut b) = (a, b);
    let (mut ka, mut kb) = (key(&a), key(&b));
    loop {
        if kb < ka {
            to[o] = b;
            o += 1;
            j += 1;
            let Some(&next) = right.get(j) else { break };
            b = next;
            kb = key(&b);
        } else {
            to[o] = a;
            o += 1;
            i += 1;
            let Some(&next) = left.get(i) else { break };
            a = next;
            ka = key(&a);
        }
    }
    let rest = left.len() - i;
    to[o..o + rest].copy_from_slice(&left[i..]);
    to[o + rest..].copy_from_slice(&right[j..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Merging runs orders a list as a stable sort by the same key does, item
        /// for item (ties by their place in the list), on lists of random runs
        /// (each sorted, of random lengths) and on unsorted ones, with few keys
        /// (many ties) and many; scratch left over from another call changes
        /// nothing.
        #[test]
        fn sort_runs_is_a_stable_sort(
            runs in proptest::collection::vec(proptest::collection::vec(0u32..1000, 0..40), 0..12),
            shuffled in proptest::collection::vec(0u32..1000, 0..200),
            modulus in 1u32..1000,
            stale in proptest::collection::vec(0usize..50, 0..5),
        ) {
            let mut lists = vec![shuffled];
            lists.push(
                runs.into_iter()
                    .flat_map(|mut run| {
                        run.sort_by_key(|&x| x % modulus);
                        run
                    })
                    .collect(),
            );
            for list in lists {
                // Each item with its place, to tell equal keys apart.
                let list: Vec<(u32, usize)> = list.into_iter().zip(0..).collect();
                let key = |x: &(u32, usize)| x.0 % modulus;
                let mut want = list.clone();
                want.sort_by_key(key);
                let mut got = list;
                let mut buffer = vec![(7, 7); 3];
                let mut bounds = stale.clone();
                let mut read = got.clone();
                let sorted = sorted_runs(&mut read, &mut buffer, &mut bounds, key).to_vec();
                prop_assert_eq!(&sorted, &want);
                sort_runs(&mut got, &mut buffer, &mut bounds, key);
                prop_assert_eq!(got, want);
            }
        }
    }
}
