/*
 * env.pml: the faults, each bounded, and the end-of-run checks.
 */

inline expire(x) {
  printf("MSC: the lease of fence %d expires\n", x);
  assert(counter < 31); counter++; LASTWRITE(x);
  lease[x].live = 0; lease[x].rev = counter; lease[x].acq = 0
}

/* What acquisition tokens a forger can read before it writes: the fence
 * record's (fixed design), or the lease record's as well (as written). */
#ifdef WRITTEN_LEASE_TOKEN
#define KNOWABLE(b) ((b) <= nacq)
#else
#define KNOWABLE(b) ((fenced[acqFence[b]] >> (b)) & 1)
#endif

proctype Env() {
  byte x, y;
end:
  do
  /* TTL expiry under a live holder: it paused, or lost the network (a fault) */
  :: atomic { FAULT(nexp, MAXEXP) && lease[0].live && HELD(lease[0].acq) -> TAKE(nexp); expire(0) }
  :: atomic { FAULT(nexp, MAXEXP) && NF > 1 && lease[1].live && HELD(lease[1].acq) -> TAKE(nexp); expire(1) }
  :: atomic { FAULT(nexp, MAXEXP) && NF > 2 && lease[2].live && HELD(lease[2].acq) -> TAKE(nexp); expire(2) }
  /* TTL expiry of a lease nobody renews (its holder crashed) */
  :: atomic { lease[0].live && !HELD(lease[0].acq) && WANT(0) -> expire(0) }
  :: atomic { NF > 1 && lease[1].live && !HELD(lease[1].acq) && WANT(1) -> expire(1) }
  :: atomic { NF > 2 && lease[2].live && !HELD(lease[2].acq) && WANT(2) -> expire(2) }
  /* the lease bucket loses its last write (power loss without
   * sync_interval: always): the next write gets its revision again */
#if MAXRB > 0
  :: atomic {
       FAULT(nrb, MAXRB) && lastKey != NONE -> TAKE(nrb);
       printf("MSC: the lease bucket loses its last write (revision %d, key %d)\n", counter, lastKey);
       lease[lastKey].live = lastPrev.live; lease[lastKey].rev = lastPrev.rev; lease[lastKey].acq = lastPrev.acq;
       counter--; lastKey = NONE; lastPrev.live = 0; lastPrev.rev = 0; lastPrev.acq = 0
     }
#endif
  /* the lease bucket is deleted and re-created: FirstSeq = the highest
   * epoch in the fence records + 1 (the clock term may be lower) */
#if MAXREC > 0
  :: atomic {
       FAULT(nrec, MAXREC) -> TAKE(nrec);
       printf("MSC: the lease bucket is re-created\n");
       x = 0; y = 0;
       do
       :: x < NF -> lease[x].live = 0; lease[x].rev = 0; lease[x].acq = 0;
          if :: frec[x].e > y -> y = frec[x].e :: else -> skip fi; x++
       :: else -> break
       od;
       counter = y; CLEARLAST; x = 0; y = 0
     }
#endif
  /* the effect log is trimmed from the front by its limits: through the
   * first position the runner has not saved (trimming what it saved is
   * harmless and not counted as a fault) */
  :: atomic {
       FAULT(ntrim, MAXTRIM) && lfirst <= llen && savedPos < llen -> TAKE(ntrim);
       printf("MSC: the log is trimmed\n");
       if
       :: lfirst <= savedPos + 1 -> lfirst = savedPos + 2
       :: else -> lfirst++
       fi
     }
  /* forged: a barrier or a write with an epoch above every issued one */
  :: atomic {
       FAULT(nforge, MAXFORGE) -> TAKE(nforge);
       printf("MSC: forged:\n");
       select (x : 0 .. NF - 1);
       if
       :: append(BARRIER, x, counter + 1, FORGED, 0, 0, 0, 0, 0)
       :: append(EFFECT, x, counter + 1, FORGED, 0, 0, 0, 1, 0)
       fi;
       x = 0
     }
  /* forged: an issued epoch, with a token the forger could read or made up */
  :: atomic {
       FAULT(nforge, MAXFORGE) && nacq > 0 ->
       select (x : 1 .. MAXACQ);
       if
       :: x <= nacq -> TAKE(nforge);
          printf("MSC: forged:\n");
          if
          :: KNOWABLE(x) -> append(BARRIER, acqFence[x], acqEpoch[x], x, 0, 0, 0, 0, 0)
          :: append(BARRIER, acqFence[x], acqEpoch[x], FORGED, 0, 0, 0, 0, 0)
          :: append(EFFECT, acqFence[x], acqEpoch[x], FORGED, 0, 0, 0, 1, 0)
          fi
       :: else -> skip
       fi;
       x = 0
     }
#ifndef WRITTEN_REOPEN
  /* forged markers: a copy of a stored effect of a job (its stamp, job and
   * key) made an abort marker, or a final, of an attempt of the forger's
   * choosing */
  :: atomic {
       FAULT(nforge, MAXFORGE) && lfirst <= llen ->
       select (x : 1 .. LOGMAX);
       if
       :: x >= lfirst && x <= llen && log[x-1].kind == EFFECT && log[x-1].j != 0 -> TAKE(nforge);
          printf("MSC: forged marker, from position %d:\n", x);
          y = log[x-1].k;
          if
          :: append(ABORT, log[x-1].f, log[x-1].e, log[x-1].a, log[x-1].j, y, 0, 0, 0)      /* its own attempt */
          :: y < 3 -> append(ABORT, log[x-1].f, log[x-1].e, log[x-1].a, log[x-1].j, 3, 0, 0, 0)   /* the highest */
          :: y < 3 -> append(EFFECT, log[x-1].f, log[x-1].e, log[x-1].a, log[x-1].j, y + 1, log[x-1].idx, 1, log[x-1].prev)
          :: y > 1 -> append(EFFECT, log[x-1].f, log[x-1].e, log[x-1].a, log[x-1].j, y - 1, log[x-1].idx, 1, log[x-1].prev)
          fi
       :: else -> skip
       fi;
       x = 0; y = 0
     }
#endif
  /* replayed: a copy of a stored message, stored again later */
  :: atomic {
       FAULT(nforge, MAXFORGE) && lfirst <= llen ->
       select (x : 1 .. LOGMAX);
       if
       :: x >= lfirst && x <= llen -> TAKE(nforge);
          printf("MSC: replayed:\n");
          append(log[x-1].kind, log[x-1].f, log[x-1].e, log[x-1].a, log[x-1].j, log[x-1].k, log[x-1].idx, log[x-1].fin, log[x-1].prev)
       :: else -> skip
       fi;
       x = 0
     }
  od
}

/* When every worker is done and the runner has decided the whole log:
 * I8 (committed means applied: every job is committed by now), all or none
 * (a job's keys all come from one attempt), I5 (each key once, checked as
 * it is applied) and nothing waits for ever (no attempt left open). A
 * stopped runner (gap) is the visible outcome the design allows instead. */
#if defined(TODAY_MARKERS) || defined(VARIANT_D)
#define RESOLVED 1
#else
/* an attempt still open waits for nothing: the runner has read the records
 * as they now stand over the whole log, or they would settle none of it */
#define RESOLVED (NOOPEN || !USEFUL || (ps == 2 && PROOFNOW))
#endif

proctype Check() {
  byte x, y, z;
  atomic {
    wended == NW && (stopped != 0 || (pos == llen && RESOLVED)) ->
    if
    :: stopped == 0 ->
       x = 0;
       do
       :: x < NP ->
          y = 1;
          do
          :: y <= NJ ->
             assert(jobApplied[SI(x, y)]);
             z = 0;
             do
             :: z < NE(y) ->
                assert(appliedKey[KI(x, y, z)]);
#ifdef VARIANT_G
                assert(appliedBy[KI(x, y, z)] == appliedBy[KI(x, y, 0)]);
#endif
                z++
             :: else -> break
             od;
             y++
          :: else -> break
          od;
          x++
       :: else -> break
       od;
       assert(NOOPEN)
    :: else -> skip
    fi
  }
}
