"""Storage: packed batch columns and their codec, series, summaries, rank rollups, combined
norms, and the FP8 and spike samples."""
