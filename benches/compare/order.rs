//! The order in which the targets run within one round.

/// The order in which `targets` run in round `round`: a balanced Latin
/// square (Williams design). Over `n` rounds (`2n` for an odd count) every
/// target runs once in each position and follows every other target exactly
/// once, so no proxy always runs first or always right after the direct
/// run, whose load (and the `TIME_WAIT` sockets it leaves) the next run
/// inherits. A plain rotation would put the same target after the direct
/// run in every round.
pub fn run_order<T: Copy>(targets: &[T], round: usize) -> Vec<T> {
    let n = targets.len();
    if n == 0 {
        return Vec::new();
    }
    // First row 0, 1, n-1, 2, n-2, ...; row r adds r (mod n).
    let first: Vec<usize> = (0..n)
        .map(|j| {
            if j % 2 == 1 {
                j.div_ceil(2)
            } else {
                (n - j / 2) % n
            }
        })
        .collect();
    let rows = if n.is_multiple_of(2) { n } else { 2 * n };
    let r = round % rows;
    let mut order: Vec<T> = first.iter().map(|&j| targets[(j + r) % n]).collect();
    if r >= n {
        // Odd n: the second half of the rounds runs the rows backwards.
        order.reverse();
    }
    order
}
