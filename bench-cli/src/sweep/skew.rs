//! AllToAllv's traffic in collbench: a skewed split, as embedding lookups
//! and mixture-of-experts routing produce. Each rank sends its whole buffer,
//! cut among the ranks by a Zipf law (weight 1/k for the k-th destination,
//! the order of destinations shuffled per sender by a fixed seed), so every
//! rank computes the same matrix and each knows what to expect from whom.

use collectives::{CallArgs, DataType, VarCounts};

/// The split of one size.
pub struct Skew {
    /// This rank's call (its counts and displacements, packed).
    pub args: CallArgs,
    /// Bytes the busiest rank sends to other ranks, over the size: what
    /// busbw is algbw times.
    pub bus_factor: f64,
    /// Where each sender's block for this rank starts in its send buffer
    /// (to check the data against the sender's pattern).
    pub sender_offsets: Vec<usize>,
}

impl Skew {
    /// Every rank sends `count` elements in all.
    pub fn new(n: usize, rank: usize, count: usize, dtype: DataType) -> Self {
        let matrix: Vec<Vec<usize>> = (0..n).map(|i| split(n, i, count)).collect();
        let send: Vec<usize> = matrix[rank].clone();
        let recv: Vec<usize> = (0..n).map(|i| matrix[i][rank]).collect();
        let sender_offsets = (0..n).map(|i| matrix[i][..rank].iter().sum()).collect();
        let to_others = (0..n).map(|i| count - matrix[i][i]).max().unwrap_or(0);
        Skew {
            args: CallArgs::all_to_all_v(dtype, VarCounts::packed(&send, &recv)),
            bus_factor: if count == 0 {
                0.0
            } else {
                to_others as f64 / count as f64
            },
            sender_offsets,
        }
    }

    pub fn counts(&self) -> &VarCounts {
        self.args.counts.as_ref().expect("alltoallv has counts")
    }
}

/// Rank `sender`'s `count` elements cut among `n` ranks by the Zipf law.
fn split(n: usize, sender: usize, count: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = 0x5eed_0000_0000_0000u64 ^ sender as u64;
    for k in (1..n).rev() {
        order.swap(k, (next(&mut rng) % (k as u64 + 1)) as usize);
    }
    let weight = |k: usize| 1.0 / (k + 1) as f64;
    let total: f64 = (0..n).map(weight).sum();
    let mut counts = vec![0; n];
    for (k, &dest) in order.iter().enumerate() {
        counts[dest] = (count as f64 * weight(k) / total) as usize;
    }
    counts[order[0]] += count - counts.iter().sum::<usize>();
    counts
}

/// splitmix64.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_add_up_and_are_skewed() {
        for n in [1, 2, 3, 8] {
            for i in 0..n {
                let s = split(n, i, 1000);
                assert_eq!(s.iter().sum::<usize>(), 1000);
                if n == 8 {
                    // The top destination gets 1/H_8 = 37%, the last 4.6%.
                    assert!(*s.iter().max().unwrap() > 2 * 1000 / 8, "{s:?}");
                    assert!(*s.iter().min().unwrap() < 1000 / 8 / 2, "{s:?}");
                }
            }
        }
        let skew = Skew::new(3, 1, 999, DataType::F32);
        assert_eq!(skew.counts().total_sent(), 999);
    }
}
