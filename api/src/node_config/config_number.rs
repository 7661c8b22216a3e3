//! serde says "invalid type: string \"abc\", expected u8" for a number of the wrong kind; the
//! operator reads "expected a whole number from 1 to 100, got \"abc\"", with TOML's line,
//! column and key around it.

use std::fmt;
use std::marker::PhantomData;

use serde::Deserializer;
use serde::de::{Error, Visitor};

/// A whole number in the range of its type (a finer range is checked with the key's name).
pub fn whole<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<i128> + Bounded,
{
    in_range(deserializer, T::MIN, T::MAX)
}

/// An active thread percentage: said to be 1 to 100 (what fits a u8 but is outside that is
/// refused with the key's name, after parsing).
pub fn thread_percentage<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u8>, D::Error> {
    let range = crate::limits::THREAD_PERCENTAGE;
    in_range(deserializer, i128::from(*range.start()), i128::from(*range.end()))
}

pub trait Bounded {
    const MIN: i128;
    const MAX: i128;
}
impl Bounded for u32 {
    const MIN: i128 = 0;
    const MAX: i128 = u32::MAX as i128;
}
impl Bounded for u64 {
    const MIN: i128 = 0;
    const MAX: i128 = u64::MAX as i128;
}

fn in_range<'de, D, T>(deserializer: D, min: i128, max: i128) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<i128>,
{
    deserializer
        .deserialize_any(WholeNumber {
            min,
            max,
            number: PhantomData,
        })
        .map(Some)
}

struct WholeNumber<T> {
    min: i128,
    max: i128,
    number: PhantomData<T>,
}

impl<T> WholeNumber<T> {
    fn refuse<E: Error>(&self, got: impl fmt::Display) -> E {
        E::custom(format!(
            "expected a whole number from {} to {}, got {got}",
            self.min, self.max
        ))
    }
}

impl<T: TryFrom<i128>> Visitor<'_> for WholeNumber<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a whole number from {} to {}", self.min, self.max)
    }

    fn visit_i64<E: Error>(self, v: i64) -> Result<T, E> {
        self.visit_i128(i128::from(v))
    }

    fn visit_u64<E: Error>(self, v: u64) -> Result<T, E> {
        self.visit_i128(i128::from(v))
    }

    /// Only what does not fit the type is refused here: a value that fits but is out of
    /// the range is refused later, in a message that names the key in full.
    fn visit_i128<E: Error>(self, v: i128) -> Result<T, E> {
        T::try_from(v).map_err(|_| self.refuse(v))
    }

    fn visit_f64<E: Error>(self, v: f64) -> Result<T, E> {
        Err(self.refuse(v))
    }

    fn visit_str<E: Error>(self, v: &str) -> Result<T, E> {
        Err(self.refuse(format_args!("{v:?}")))
    }

    fn visit_bool<E: Error>(self, v: bool) -> Result<T, E> {
        Err(self.refuse(v))
    }
}
