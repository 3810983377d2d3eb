"""Other libraries' APIs over ubep, for code written against them (`ubep.compat.deep_ep`)."""
