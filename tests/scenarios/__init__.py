"""The differential scenario engine: every combination of choices a user makes, run on real ranks and judged
against oracles that torchloom does not compute (see docs/testing.md, "The scenario engine")."""
