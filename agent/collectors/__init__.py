"""Sources of observations. Each collector splits fetch (I/O) from a pure ``parse`` tested on saved text."""
