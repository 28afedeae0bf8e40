//! Element types a collective can carry, named as users and nccl-tests name them.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

/// The element type of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DataType {
    F32 = 1,
    F64,
    F16,
    Bf16,
    I8,
    U8,
    I32,
    U32,
    I64,
    U64,
}

impl DataType {
    pub const ALL: [DataType; 10] = [
        DataType::F32,
        DataType::F64,
        DataType::F16,
        DataType::Bf16,
        DataType::I8,
        DataType::U8,
        DataType::I32,
        DataType::U32,
        DataType::I64,
        DataType::U64,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::F32 | DataType::I32 | DataType::U32 => 4,
            DataType::F64 | DataType::I64 | DataType::U64 => 8,
        }
    }

    /// The name nccl-tests prints in its `type` column.
    pub const fn name(self) -> &'static str {
        match self {
            DataType::F32 => "float",
            DataType::F64 => "double",
            DataType::F16 => "half",
            DataType::Bf16 => "bfloat16",
            DataType::I8 => "int8",
            DataType::U8 => "uint8",
            DataType::I32 => "int32",
            DataType::U32 => "uint32",
            DataType::I64 => "int64",
            DataType::U64 => "uint64",
        }
    }

    /// The Rust name, also accepted by [`FromStr`].
    pub const fn rust_name(self) -> &'static str {
        match self {
            DataType::F32 => "f32",
            DataType::F64 => "f64",
            DataType::F16 => "f16",
            DataType::Bf16 => "bf16",
            DataType::I8 => "i8",
            DataType::U8 => "u8",
            DataType::I32 => "i32",
            DataType::U32 => "u32",
            DataType::I64 => "i64",
            DataType::U64 => "u64",
        }
    }

    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F32 | DataType::F64 | DataType::F16 | DataType::Bf16
        )
    }

    pub(crate) fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|d| *d as u8 == v)
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.rust_name())
    }
}

impl FromStr for DataType {
    type Err = String;

    /// Accepts Rust names (`f32`), nccl-tests names (`float`) and the usual
    /// aliases (`fp16`, `bfloat16`, `int`).
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.to_ascii_lowercase();
        let found = Self::ALL
            .into_iter()
            .find(|d| d.rust_name() == s || d.name() == s)
            .or(match s.as_str() {
                "fp32" | "float32" => Some(DataType::F32),
                "fp64" | "float64" => Some(DataType::F64),
                "fp16" | "float16" => Some(DataType::F16),
                "bfp16" | "bf16" => Some(DataType::Bf16),
                "int" => Some(DataType::I32),
                "char" => Some(DataType::I8),
                _ => None,
            });
        found.ok_or_else(|| {
            let names: Vec<_> = Self::ALL.iter().map(|d| d.rust_name()).collect();
            format!("unknown datatype '{s}' (one of {})", names.join(", "))
        })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Rust types that map onto a [`DataType`]; the typed API takes slices of these.
pub trait Element: bytemuck::Pod + sealed::Sealed + Send + Sync {
    const DTYPE: DataType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = DataType::$d;
        }
    )*};
}

element!(
    f32 => F32, f64 => F64, f16 => F16, bf16 => Bf16, i8 => I8, u8 => U8,
    i32 => I32, u32 => U32, i64 => I64, u64 => U64,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for d in DataType::ALL {
            assert_eq!(d.name().parse::<DataType>(), Ok(d));
            assert_eq!(d.rust_name().parse::<DataType>(), Ok(d));
            assert_eq!(DataType::from_u8(d as u8), Some(d));
        }
        assert!("complex".parse::<DataType>().is_err());
    }
}
