-- PLACEHOLDER, NOT FOR MERGE: version 15 belongs to another branch of the same series (issue 38); this
-- branch (c38-catchup) owns version 16 only. It keeps the versions 1..n without a gap so that this branch
-- runs alone. Drop this file when merging: with the real 0015 next to it, schema.migrations() refuses two
-- version-15 files, so a merge that kept both fails every store at once.
SELECT 1;
