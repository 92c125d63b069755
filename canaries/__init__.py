"""Layer 3, canaries (imported as dpaudit.canaries): new-token canaries for membership-inference audits: make,
insert into data, extend a model's vocabulary. May import: core, accounting, audit."""
