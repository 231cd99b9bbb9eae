//! How important a request is when it waits for a place at the backend: four strict levels,
//! from `low` (shed first) to `critical` (the only one that may take the places kept in reserve).
//! A request's level is its operation's (the gateway config's `[upstream_priority]` table, for
//! instance `createPet = "critical"`, `listPets = "normal"`) moved up or down by its plan's
//! `priority` (a plan file's `priority = 1` puts Enterprise's requests a level above Free's).

use std::fmt;

use crate::keys::plans::COSTED_OPERATIONS;

/// A request's level, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum Level {
    Low = 0,
    Normal = 1,
    High = 2,
    Critical = 3,
}

impl Level {
    /// Every level, lowest first.
    pub const ALL: [Level; 4] = [Level::Low, Level::Normal, Level::High, Level::Critical];
    pub const COUNT: usize = 4;

    pub fn name(self) -> &'static str {
        match self {
            Level::Low => "low",
            Level::Normal => "normal",
            Level::High => "high",
            Level::Critical => "critical",
        }
    }

    pub fn parse(text: &str) -> Option<Level> {
        Level::ALL.into_iter().find(|l| l.name() == text)
    }

    pub fn index(self) -> usize {
        self as usize
    }

    /// This level moved `steps` up (down when negative), held between `low` and `critical`.
    pub fn shifted(self, steps: i8) -> Level {
        let at = (self as i64 + i64::from(steps)).clamp(0, Level::COUNT as i64 - 1);
        Level::ALL[at as usize]
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Each forwarded operation's level ([`COSTED_OPERATIONS`] order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Priorities {
    by_operation: [Level; COSTED_OPERATIONS.len()],
}

impl Default for Priorities {
    /// What the shipped configs say: creating a pet (an adoption under way) above reading the
    /// list, reading orders (not implemented yet) shed first.
    fn default() -> Self {
        Priorities {
            by_operation: [
                Level::Normal,   // listPets
                Level::Critical, // createPet
                Level::Normal,   // getPet
                Level::Low,      // listOrders
            ],
        }
    }
}

impl Priorities {
    /// The built-in level of `operation` (one of [`COSTED_OPERATIONS`]).
    pub fn default_of(operation: &str) -> Level {
        let at = COSTED_OPERATIONS.iter().position(|o| *o == operation);
        at.map_or(Level::Normal, |i| Priorities::default().by_operation[i])
    }

    /// These levels with `operation`'s set to `level`; false when no such operation.
    pub fn set(&mut self, operation: &str, level: Level) -> bool {
        match COSTED_OPERATIONS.iter().position(|o| *o == operation) {
            Some(i) => {
                self.by_operation[i] = level;
                true
            }
            None => false,
        }
    }

    /// The level of a request for operation `index` of [`COSTED_OPERATIONS`] (anything else is
    /// `normal`) on a plan whose `priority` is `plan_steps`.
    pub fn level(&self, index: Option<usize>, plan_steps: i8) -> Level {
        let base = index
            .and_then(|i| self.by_operation.get(i))
            .copied()
            .unwrap_or(Level::Normal);
        base.shifted(plan_steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_operations_level_moves_with_its_plan_and_stays_within_the_levels() {
        let p = Priorities::default();
        let create = COSTED_OPERATIONS.iter().position(|o| *o == "createPet");
        let list = COSTED_OPERATIONS.iter().position(|o| *o == "listPets");
        assert_eq!(p.level(create, 0), Level::Critical);
        assert_eq!(p.level(list, 0), Level::Normal);
        assert_eq!(p.level(list, 1), Level::High);
        assert_eq!(p.level(list, -3), Level::Low);
        assert_eq!(p.level(create, 2), Level::Critical);
        assert_eq!(p.level(None, 0), Level::Normal);
        let mut q = p;
        assert!(q.set("listPets", Level::Low) && !q.set("feedPet", Level::Low));
        assert_eq!(q.level(list, 1), Level::Normal);
        assert_eq!(Level::parse("high"), Some(Level::High));
        assert_eq!(Level::parse("High"), None);
    }
}
