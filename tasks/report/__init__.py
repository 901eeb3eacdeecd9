"""report.md from a run folder: the lane sections, bench tables and correctness sections. Above
record/ (what it reads) and correctness/ (whose sections it embeds)."""
