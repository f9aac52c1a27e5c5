"""The rank-file format: the kinds of event a rank writes, their typed records, and the format version."""
