//! Which Cluster primary serves a command: the key's slot (Redis Cluster's hash-tag rule) and
//! the slot ranges `CLUSTER NODES` lists per primary. The Cluster's gather (`gather.rs`) uses
//! it to put commands for one primary into one pipeline; nothing here has to be exact,
//! because a command sent to the wrong node is answered `MOVED` and sent again on its own
//! through the cluster client, which follows the redirect.

use redis::{Arg, Cmd};

/// Slots in a Redis Cluster.
const SLOTS: usize = 16_384;

/// The slot of `key`: CRC16 (XMODEM) of its hash tag — the bytes between the first `{` and
/// the next `}`, when there are any — or of the whole key, modulo the slot count.
pub(super) fn key_slot(key: &[u8]) -> u16 {
    let tagged = key
        .splitn(2, |&b| b == b'{')
        .nth(1)
        .and_then(|rest| {
            rest.split(|&b| b == b'}')
                .next()
                .filter(|_| rest.contains(&b'}'))
        })
        .filter(|tag| !tag.is_empty());
    let hashed = tagged.unwrap_or(key);
    // The slot count is a power of two below 2^16: the remainder fits.
    (crc16::State::<crc16::XMODEM>::calculate(hashed) as usize % SLOTS) as u16
}

/// The slot of the first key `cmd` names: `EVALSHA`/`EVAL`'s first KEYS entry, any other
/// command's first argument. `None` for a script without keys or a command without
/// arguments (the cluster client routes those itself).
pub(super) fn command_slot(cmd: &Cmd) -> Option<u16> {
    let mut args = cmd.args_iter().map(|arg| match arg {
        Arg::Simple(bytes) => Some(bytes),
        _ => None,
    });
    let name = args.next()??;
    let key = if name.eq_ignore_ascii_case(b"EVALSHA") || name.eq_ignore_ascii_case(b"EVAL") {
        let _script = args.next()??;
        let keys: usize = std::str::from_utf8(args.next()??).ok()?.parse().ok()?;
        if keys == 0 {
            return None;
        }
        args.next()??
    } else {
        args.next()??
    };
    Some(key_slot(key))
}

/// Each slot's primary, as an index into the primaries `CLUSTER NODES` listed.
pub(super) struct SlotOwners {
    /// Per slot: its primary's index, or [`UNKNOWN`].
    owners: Box<[u16]>,
}

const UNKNOWN: u16 = u16::MAX;

impl Default for SlotOwners {
    /// Nobody known: every command goes on its own until a map is read.
    fn default() -> Self {
        SlotOwners {
            owners: vec![UNKNOWN; SLOTS].into_boxed_slice(),
        }
    }
}

impl SlotOwners {
    /// From a `CLUSTER NODES` reply: the slot ranges of each primary that is not failed.
    /// Slots being migrated (`[slot->-node]`, `[slot-<-node]`) are left to the redirects.
    pub(super) fn from_cluster_nodes(nodes: &str) -> Self {
        let mut map = SlotOwners::default();
        for (index, primary) in primaries(nodes).enumerate() {
            let Ok(index) = u16::try_from(index) else {
                break;
            };
            for range in primary.slots {
                let (first, last) = match range.split_once('-') {
                    Some((first, last)) => (first.parse::<usize>(), last.parse::<usize>()),
                    None => (range.parse::<usize>(), range.parse::<usize>()),
                };
                if let (Ok(first), Ok(last)) = (first, last)
                    && let Some(slots) = map.owners.get_mut(first..=last)
                {
                    slots.fill(index);
                }
            }
        }
        map
    }

    /// The index of `slot`'s primary, when the map knows it.
    pub(super) fn owner(&self, slot: u16) -> Option<u16> {
        self.owners
            .get(usize::from(slot))
            .copied()
            .filter(|&o| o != UNKNOWN)
    }
}

/// One primary's line of `CLUSTER NODES`.
pub(super) struct Primary<'a> {
    pub host: &'a str,
    pub port: u16,
    /// Its slot fields: `first-last`, `slot`, or a bracketed migration mark.
    slots: std::str::SplitWhitespace<'a>,
}

/// The primaries of a `CLUSTER NODES` reply, in its order; failed ones are left out (their
/// slots are listed under a replica once it took over).
pub(super) fn primaries(nodes: &str) -> impl Iterator<Item = Primary<'_>> {
    nodes.lines().filter_map(|line| {
        let mut fields = line.split_whitespace();
        let address = fields.nth(1)?;
        let flags = fields.next()?;
        let flag = |f: &str| flags.split(',').any(|x| x == f);
        if !flag("master") || flag("fail") || flag("noaddr") {
            return None;
        }
        // `ip:port@cport[,hostname]`
        let (host, port) = address.split(['@', ',']).next()?.rsplit_once(':')?;
        // Master id, ping sent, pong received, config epoch, link state; then the slots.
        for _ in 0..5 {
            fields.next()?;
        }
        Some(Primary {
            host,
            port: port.parse().ok()?,
            slots: fields,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::{SlotOwners, command_slot, key_slot, primaries};

    /// Slots Redis itself computes (`CLUSTER KEYSLOT`).
    #[test]
    fn slots_follow_the_hash_tag_rule() {
        assert_eq!(key_slot(b"foo"), 12_182);
        assert_eq!(key_slot(b"bar"), 5_061);
        assert_eq!(key_slot(b"123456789"), 12_739);
        // The tag is what is hashed, wherever it sits.
        assert_eq!(key_slot(b"idemgate:{foo}:record"), 12_182);
        assert_eq!(key_slot(b"{foo}:queue"), key_slot(b"x{foo}y"));
        // An empty tag or an unclosed brace: the whole key.
        assert_eq!(key_slot(b"{}foo"), 9_500);
        assert_eq!(key_slot(b"foo{"), key_slot(b"foo{"));
        assert_ne!(key_slot(b"foo{"), key_slot(b"foo"));
        // Only the first tag counts.
        assert_eq!(key_slot(b"{foo}{bar}"), 12_182);
    }

    #[test]
    fn a_command_is_routed_by_its_first_key() {
        let set = redis::cmd("SET")
            .arg("idemgate:{foo}:record")
            .arg("v")
            .clone();
        assert_eq!(command_slot(&set), Some(12_182));
        let script = redis::cmd("EVALSHA")
            .arg("abc")
            .arg(2)
            .arg("idemgate:{bar}:record")
            .arg("idemgate:{bar}:queue")
            .arg("owner")
            .clone();
        assert_eq!(command_slot(&script), Some(5_061));
        let keyless = redis::cmd("evalsha").arg("abc").arg(0).arg("x").clone();
        assert_eq!(command_slot(&keyless), None);
        assert_eq!(command_slot(&redis::cmd("PING")), None);
    }

    const NODES: &str = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7002@17002,redis-b master - 0 1 2 connected 5461-10921 10922 [10923->-e5]
c3 127.0.0.1:7003@17003 master,fail - 0 1 3 disconnected
d4 127.0.0.1:7004@17004 slave a1 0 1 1 connected
e5 [::1]:7005@17005 master - 0 1 5 connected 10923-16383
f6 127.0.0.1:7006@17006 master - 0 1 6 connected
";

    #[test]
    fn slot_owners_come_from_cluster_nodes() {
        let listed: Vec<_> = primaries(NODES).map(|p| (p.host, p.port)).collect();
        assert_eq!(
            listed,
            vec![
                ("127.0.0.1", 7001),
                ("127.0.0.1", 7002),
                ("[::1]", 7005),
                ("127.0.0.1", 7006),
            ]
        );
        let owners = SlotOwners::from_cluster_nodes(NODES);
        for (slot, owner) in [
            (0, Some(0)),
            (5_460, Some(0)),
            (5_461, Some(1)),
            (10_922, Some(1)),
            (10_923, Some(2)),
            (16_383, Some(2)),
        ] {
            assert_eq!(owners.owner(slot), owner, "slot {slot}");
        }
        assert_eq!(SlotOwners::default().owner(0), None);
        // A primary without slots, a failed one's and garbage own nothing.
        let partial = SlotOwners::from_cluster_nodes(
            "x 127.0.0.1:1@2 master - 0 0 1 connected 0-9 junk 20-10 99999\n",
        );
        assert_eq!(partial.owner(9), Some(0));
        assert_eq!(partial.owner(10), None);
        assert_eq!(partial.owner(15), None);
    }
}
