//! The filter's decoding of sidecar answers: the head is parsed into a [`Node`] tree and the
//! answer type's own `Deserialize` reads it back through a deserializer whose error carries no
//! message. serde_json's typed decoding formats every invalid value into its error as it
//! builds it, floats included, and that alone links Rust's and serde_json's float printers
//! into the filter, with a typed parser per answer type (~33 KB of its 256 KiB budget); the
//! filter drops the message anyway (a malformed answer is a sidecar failure whatever it says).
//! The sidecar and the tools keep [`crate::decode`], whose errors say what is wrong.
//!
//! The answer types' derived `Deserialize` decides what is accepted, as with
//! [`crate::decode`]: the same fields, defaults, unknown fields ignored or denied, lengths,
//! a field named twice refused. The tree borrows the frame's strings where they hold no
//! escapes and keeps an object's fields in order (no map is built).

use alloc::borrow::Cow;
use alloc::vec::Vec;
use core::fmt;

use serde::Deserialize;
use serde::de::value::{MapDeserializer, SeqDeserializer};
use serde::de::{self, DeserializeOwned, IntoDeserializer, Visitor};

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
    let head: Node<'_> = serde_json::from_slice(head).map_err(|_| Malformed)?;
    Ok((T::deserialize(Tree(&head))?, payload))
}

/// A JSON document as parsed, its strings borrowed from the frame where they can be.
enum Node<'a> {
    Null,
    Bool(bool),
    U64(u64),
    I64(i64),
    F64(f64),
    Str(Cow<'a, str>),
    Seq(Vec<Node<'a>>),
    /// Fields in document order, names as [`Node::Str`].
    Map(Vec<(Node<'a>, Node<'a>)>),
}

impl<'de> Deserialize<'de> for Node<'de> {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(NodeVisitor)
    }
}

/// Takes every kind of value serde_json's parser hands out, so none is refused with a message.
struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E>(self) -> Result<Node<'de>, E> {
        Ok(Node::Null)
    }

    fn visit_bool<E>(self, v: bool) -> Result<Node<'de>, E> {
        Ok(Node::Bool(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Node<'de>, E> {
        Ok(Node::U64(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Node<'de>, E> {
        Ok(Node::I64(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Node<'de>, E> {
        Ok(Node::F64(v))
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Node<'de>, E> {
        Ok(Node::Str(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Node<'de>, E> {
        Ok(Node::Str(Cow::Owned(v.into())))
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut items: A) -> Result<Node<'de>, A::Error> {
        let mut seq = Vec::new();
        while let Some(item) = items.next_element()? {
            seq.push(item);
        }
        Ok(Node::Seq(seq))
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut fields: A) -> Result<Node<'de>, A::Error> {
        // Room for every field an answer's object has (five at most): one allocation each.
        let mut map = Vec::with_capacity(8);
        while let Some(field) = fields.next_entry()? {
            map.push(field);
        }
        Ok(Node::Map(map))
    }
}

/// A deserializer over a parsed node.
struct Tree<'a, 'de>(&'a Node<'de>);

impl<'a, 'de> IntoDeserializer<'de, Malformed> for Tree<'a, 'de> {
    type Deserializer = Self;

    fn into_deserializer(self) -> Self {
        self
    }
}

impl<'de> de::Deserializer<'de> for Tree<'_, 'de> {
    type Error = Malformed;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Malformed> {
        match self.0 {
            Node::Null => visitor.visit_unit(),
            Node::Bool(b) => visitor.visit_bool(*b),
            Node::U64(u) => visitor.visit_u64(*u),
            Node::I64(i) => visitor.visit_i64(*i),
            Node::F64(f) => visitor.visit_f64(*f),
            Node::Str(s) => visitor.visit_str(s),
            Node::Seq(items) => {
                let mut items = SeqDeserializer::new(items.iter().map(Tree));
                let value = visitor.visit_seq(&mut items)?;
                // Elements the visitor left are an error, as with the typed decoding.
                items.end()?;
                Ok(value)
            }
            Node::Map(fields) => {
                let mut fields =
                    MapDeserializer::new(fields.iter().map(|(k, v)| (Tree(k), Tree(v))));
                let value = visitor.visit_map(&mut fields)?;
                fields.end()?;
                Ok(value)
            }
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Malformed> {
        match self.0 {
            Node::Null => visitor.visit_none(),
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
            Node::Str(s) => visitor.visit_enum(s.as_ref().into_deserializer()),
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
