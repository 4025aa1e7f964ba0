//! Owner ranges of the reactor: each subscriber draws its user tokens and timer keys from a
//! range of its own, so whoever routes an event finds its owner from the token or key alone.
//!
//! A range is one byte. A timer key carries it as its top byte (the subscriber picks the rest);
//! a user token carries it in bits 48..56 above a counter of its own, under `INTERNAL_BASE`.
//! Range 0 is the default one `token()` draws from: a reactor user that routes nothing by owner
//! (a test, a tool) never needs to name a range.

use mio::Token;

use super::Reactor;

/// A subscriber's share of the user tokens and timer keys (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Range(pub u8);

/// Where a token's range sits: the 16 bits below the top of a `usize` hold it (the top bit
/// stays clear for the reactor's internal tokens), the bits below count.
const TOKEN_SHIFT: u32 = usize::BITS - 16;
const KEY_SHIFT: u32 = u64::BITS - 8;

impl Range {
    /// The range `token()` draws from.
    pub const DEFAULT: Range = Range(0);

    /// The range a user token was drawn from.
    pub const fn of_token(token: Token) -> Range {
        Range((token.0 >> TOKEN_SHIFT) as u8)
    }

    /// The range of a timer key: its top byte.
    pub const fn of_timer_key(key: u64) -> Range {
        Range((key >> KEY_SHIFT) as u8)
    }

    /// Timer key `n` of this range (`n` keeps below 2^56; its top byte is the range's).
    pub const fn timer_key(self, n: u64) -> u64 {
        ((self.0 as u64) << KEY_SHIFT) | (n & ((1 << KEY_SHIFT) - 1))
    }
}

impl<M: Send + 'static> Reactor<M> {
    /// A fresh token of `range`, never handed out before.
    pub fn token_in(&mut self, range: Range) -> Token {
        let next = &mut self.next_user_token[usize::from(range.0)];
        debug_assert!(*next < 1 << TOKEN_SHIFT, "token range {range:?} exhausted");
        let t = Token((usize::from(range.0) << TOKEN_SHIFT) | *next);
        *next += 1;
        t
    }
}

/// A fresh counter per range; range 0 starts at 1 because token 0 is the waker's.
pub(super) fn counters() -> Vec<usize> {
    vec![1; 256]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_and_keys_carry_their_range() {
        let mut r = Reactor::<()>::new(1, 1).unwrap();
        assert_eq!(r.token(), Token(1), "the default range counts up from 1");
        let a = r.token_in(Range(b'k'));
        let b = r.token_in(Range(b'k'));
        let c = r.token_in(Range(0xff));
        assert_ne!(a, b);
        assert_eq!(Range::of_token(a), Range(b'k'));
        assert_eq!(Range::of_token(c), Range(0xff));
        assert_eq!(Range::of_token(r.token()), Range::DEFAULT);
        assert!(
            c.0 < super::super::INTERNAL_BASE,
            "user tokens stay user tokens"
        );
        let key = Range(3).timer_key(9);
        assert_eq!((Range::of_timer_key(key), key & 0xff), (Range(3), 9));
        assert_eq!(Range::of_timer_key(0x7072 << 48), Range(0x70));
    }
}
