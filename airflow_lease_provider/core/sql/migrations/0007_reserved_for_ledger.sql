-- Version 7: PLACEHOLDER on branch `perf` only. Version 7 is reserved for the ledger work (run columns of
-- the event table); this empty step keeps the migrations gapless until that lands. The integrator drops
-- this file in favour of ledger's 0007.
SELECT 1;
