//! The filter's decoding of sidecar answers: the head is parsed into a [`serde_json::Value`]
//! (which the filter parses for its configuration and body keys anyway) and the answer type's
//! own `Deserialize` reads it through [`Tree`], a deserializer whose error carries no
//! message. serde_json's typed decoding formats every invalid value into its error as it
//! builds it, floats included, and that alone links Rust's and serde_json's float printers
//! into the filter (~9 KB of its 256 KiB budget); the filter drops the message anyway (a
//! malformed answer is a sidecar failure whatever it says). The sidecar and the tools keep
//! [`crate::decode`], whose errors say what is wrong.
//!
//! The answer types' derived `Deserialize` decides what is accepted, as with
//! [`crate::decode`]: the same fields, defaults, unknown fields ignored or denied, lengths.
//! One difference: a JSON object naming a field twice keeps its last value (as a `Value`
//! does) where the typed decoding refuses it; the sidecar's serializer never writes one.

use core::fmt;

use serde::de::value::{MapDeserializer, SeqDeserializer};
use serde::de::{self, DeserializeOwned, IntoDeserializer, Visitor};
use serde_json::Value;

/// A frame whose head is not the JSON of the expected answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Malformed;

impl fmt::Display for Malformed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("malformed idemgate answer")
    }
}

impl core::error::Error for Malformed {}

impl de::Error for Malformed {
    /// The message is dropped unformatted: formatting it is what this module avoids.
    fn custom<T: fmt::Display>(_: T) -> Self {
        Malformed
    }
}

/// Like [`crate::decode`], with a message-less error (see the module's doc): the filter's
/// decoding of the sidecar's answers.
pub fn decode_answer<T: DeserializeOwned>(frame: &[u8]) -> Result<(T, &[u8]), Malformed> {
    let (head, payload) = crate::split(frame);
    let head: Value = serde_json::from_slice(head).map_err(|_| Malformed)?;
    Ok((T::deserialize(Tree(&head))?, payload))
}

/// A deserializer over a parsed JSON value.
struct Tree<'a>(&'a Value);

impl<'de> IntoDeserializer<'de, Malformed> for Tree<'de> {
    type Deserializer = Self;

    fn into_deserializer(self) -> Self {
        self
    }
}

impl<'de> de::Deserializer<'de> for Tree<'de> {
    type Error = Malformed;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Malformed> {
        match self.0 {
            Value::Null => visitor.visit_unit(),
            Value::Bool(b) => visitor.visit_bool(*b),
            Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
                (Some(u), _, _) => visitor.visit_u64(u),
                (None, Some(i), _) => visitor.visit_i64(i),
                (None, None, Some(f)) => visitor.visit_f64(f),
                (None, None, None) => Err(Malformed),
            },
            Value::String(s) => visitor.visit_borrowed_str(s),
            Value::Array(items) => {
                let mut items = SeqDeserializer::new(items.iter().map(Tree));
                let value = visitor.visit_seq(&mut items)?;
                // Elements the visitor left are an error, as with the typed decoding.
                items.end()?;
                Ok(value)
            }
            Value::Object(fields) => {
                let mut fields =
                    MapDeserializer::new(fields.iter().map(|(k, v)| (k.as_str(), Tree(v))));
                let value = visitor.visit_map(&mut fields)?;
                fields.end()?;
                Ok(value)
            }
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Malformed> {
        match self.0 {
            Value::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    /// Enums are read from their variant's name (the answers' `outcome` tags).
    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Malformed> {
        match self.0 {
            Value::String(s) => visitor.visit_enum(s.as_str().into_deserializer()),
            _ => Err(Malformed),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Malformed> {
        visitor.visit_newtype_struct(self)
    }

    /// An ignored (unknown) field is accepted whatever its value, floats included.
    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Malformed> {
        visitor.visit_unit()
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct seq tuple tuple_struct map struct identifier
    }
}
