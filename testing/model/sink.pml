/*
 * sink.pml: the stream sink runner (sink/streamsink) in front of a
 * deduping destination. It decides the log in order (reading a missing
 * position from the stream, as fill does, so a redelivery's order never
 * reaches a decision), applies a job's effects all or none, saves
 * (position, fences) and crashes and resumes from what it saved.
 */

/* May (e, a) raise fence id ff? An epoch rises only if the lease bucket
 * issued it for this fence: (e, a) must be an acquisition that fenced the
 * fence record. (sink/verify.go EpochCheck; target: "verified epochs") */
inline verify(ff, ee, aa, out) {
#if defined(VARIANT_C)
  out = ADMIT
#elif defined(VARIANT_F)
  /* the epoch alone */
  out = UNVERIFIED;
  vi = 1;
  do
  :: vi <= nacq -> if :: acqFence[vi] == ff && acqEpoch[vi] == ee && (fenced[ff] >> vi) & 1 -> out = ADMIT :: else -> skip fi; vi++
  :: else -> break
  od;
  vi = 0
#elif defined(TODAY_VERIFY)
  /* sink.EpochCheck today: an epoch at or below the highest the fence
   * record holds verifies, whatever its acquisition */
  out = UNVERIFIED;
  vi = 1;
  do
  :: vi <= nacq -> if :: acqFence[vi] == ff && acqEpoch[vi] >= ee && (fenced[ff] >> vi) & 1 -> out = ADMIT :: else -> skip fi; vi++
  :: else -> break
  od;
  vi = 0
#elif defined(WRITTEN_RECENT)
  /* one recent epoch: the record's own */
  if
  :: frec[ff].e == ee && frec[ff].a == aa -> out = ADMIT
  :: else -> out = UNVERIFIED
  fi
#else
  if
  :: aa != FORGED && aa != 0 && aa <= nacq && acqFence[aa] == ff && acqEpoch[aa] == ee && ((fenced[ff] >> aa) & 1) -> out = ADMIT
#ifdef WRITTEN_LEASE_TOKEN
  /* or the lease key's current record */
  :: lease[ff].live && lease[ff].rev == ee && lease[ff].acq == aa -> out = ADMIT
#endif
  :: else -> out = UNVERIFIED
  fi
#endif
}

/* Apply job jj of fence ff if its open attempt is complete and the job its
 * final names as previous is applied: every effect in one step, each key
 * once (dedupe by scope and key). */
inline tryApply(ff, jj) {
  si = SI(ff, jj);
  if
  :: slot[si].on && slot[si].fin && slot[si].got == FULL(jj) &&
     (slot[si].prev == 0 || PREVAPPLIED(ff, slot[si].prev)) ->
     /* I3: never below the fence id's highest admitted stamp, never split brain, never forged */
     assert(slot[si].e == gF[ff].e && slot[si].a == gF[ff].a);
     assert(slot[si].a != FORGED);
     /* all or none: before this step the job's keys are none or all applied */
     assert(appliedKey[KI(ff, jj, 0)] == appliedKey[KI(ff, jj, NE(jj) - 1)]);
     vi = 0;
     do
     :: vi < NE(jj) ->
        if
        :: !appliedKey[KI(ff, jj, vi)] -> appliedKey[KI(ff, jj, vi)] = 1
        :: else -> skip   /* I5: a key is applied once (dedupe by scope and key) */
        fi;
        vi++
     :: else -> break
     od;
     vi = 0;
     jobApplied[si] = 1;
     printf("MSC: sink applies job %d of fence %d (epoch %d acquisition %d attempt %d)\n", jj, ff, slot[si].e, slot[si].a, slot[si].k);
#ifdef WRITTEN_STATE
     memApplied[si] = 1;
#endif
     slot[si].on = 0; slot[si].e = 0; slot[si].a = 0; slot[si].k = 0; slot[si].got = 0; slot[si].fin = 0; slot[si].prev = 0
  :: else -> skip
  fi;
  si = 0
}

inline clearSlot(s) {
  slot[s].on = 0; slot[s].e = 0; slot[s].a = 0; slot[s].k = 0; slot[s].got = 0; slot[s].fin = 0; slot[s].prev = 0
}

/* an admitted effect with job headers */
inline onJobEffect(p) {
  si = SI(log[p].f, log[p].j);
#ifdef VARIANT_G
  /* applied at once, key by key */
  assert(log[p].e == gF[log[p].f].e && log[p].a == gF[log[p].f].a);
  if
  :: !appliedKey[KI(log[p].f, log[p].j, log[p].idx)] ->
     /* all or none: a job's keys all come from one attempt */
     vi = 0;
     do
     :: vi < NE(log[p].j) ->
        assert(!appliedKey[KI(log[p].f, log[p].j, vi)] || appliedBy[KI(log[p].f, log[p].j, vi)] == ((log[p].a << 2) | log[p].k));
        vi++
     :: else -> break
     od;
     vi = 0;
     appliedKey[KI(log[p].f, log[p].j, log[p].idx)] = 1;
     appliedBy[KI(log[p].f, log[p].j, log[p].idx)] = (log[p].a << 2) | log[p].k;
     if
     :: log[p].fin -> jobApplied[si] = 1
     :: else -> skip
     fi
  :: else -> skip
  fi
#else
  if
#ifndef WRITTEN_REOPEN
  :: jobApplied[si] -> skip   /* a job applied already: a duplicate, acked and dropped */
#endif
  :: slot[si].on && slot[si].e == log[p].e && slot[si].a == log[p].a && slot[si].k > log[p].k ->
     skip                     /* an earlier attempt, superseded */
  :: else ->
     if
     :: slot[si].on && slot[si].e == log[p].e && slot[si].a == log[p].a && slot[si].k == log[p].k -> skip
     :: else ->                /* a new attempt supersedes an open one */
        clearSlot(si);
        slot[si].on = 1; slot[si].e = log[p].e; slot[si].a = log[p].a; slot[si].k = log[p].k
     fi;
     slot[si].got = slot[si].got | (1 << log[p].idx);
     if
     :: log[p].fin -> slot[si].fin = 1; slot[si].prev = log[p].prev
     :: else -> skip
     fi;
     tryApply(log[p].f, 1);
     tryApply(log[p].f, 2)
  fi;
#endif
  si = 0
}

/* decide the message at position p+1 (log[p]) against the fences */
inline decide(p) {
  if
  :: log[p].kind == GARBAGE -> skip      /* bad stamp: terminated, counted */
  :: else ->
     fs = FSLOT(log[p].f);
     /* I7: a fence id is judged only against its own epochs */
     assert(fence[fs].e == 0 || fence[fs].setter == log[p].f);
     if
     :: log[p].e < fence[fs].e -> v = STALE
#ifdef VARIANT_F
     :: log[p].e == fence[fs].e -> v = ADMIT
#else
     :: log[p].e == fence[fs].e && log[p].a == fence[fs].a -> v = ADMIT
     :: log[p].e == fence[fs].e -> v = SPLIT
#endif
     :: else ->
        verify(log[p].f, log[p].e, log[p].a, v);
        if
        :: v == ADMIT ->
           /* the fence rises at this position; open attempts below it are
            * abandoned (their jobs were not committed: see README) */
           fence[fs].e = log[p].e; fence[fs].a = log[p].a; fence[fs].setter = log[p].f;
           printf("MSC: sink raises fence %d to %d/%d at position %d\n", fs, log[p].e, log[p].a, p + 1);
           if
           :: log[p].f < NP ->
              vi = 1;
              do
              :: vi <= NJ ->
                 if
                 :: slot[SI(log[p].f, vi)].on && slot[SI(log[p].f, vi)].e < log[p].e -> clearSlot(SI(log[p].f, vi))
                 :: else -> skip
                 fi;
                 vi++
              :: else -> break
              od;
              vi = 0
           :: else -> skip
           fi
        :: else -> skip
        fi
     fi;
     if
     :: v == ADMIT ->
        if
        :: log[p].e > gF[log[p].f].e -> gF[log[p].f].e = log[p].e; gF[log[p].f].a = log[p].a
        :: else -> skip
        fi;
        if
        :: log[p].kind == BARRIER -> skip
        :: log[p].kind == ABORT ->
           si = SI(log[p].f, log[p].j);
           if
           :: slot[si].on && slot[si].e == log[p].e && slot[si].a == log[p].a && slot[si].k <= log[p].k -> clearSlot(si)
           :: else -> skip
           fi;
           si = 0
        :: log[p].kind == EFFECT && log[p].j == 0 ->
           /* a write without job headers: applies on its own (I3) */
           assert(log[p].e == gF[log[p].f].e && log[p].a == gF[log[p].f].a);
           assert(log[p].a != FORGED);
           lockKey[log[p].a] = 1;
           printf("MSC: sink applies the write of fence %d epoch %d acquisition %d\n", log[p].f, log[p].e, log[p].a)
        :: else -> onJobEffect(p)
        fi
     :: else ->                          /* refused: stale, split brain or unverified */
        printf("MSC: sink refuses position %d (verdict %d: 2 stale, 3 split brain, 4 unverified; fence %d/%d)\n", p + 1, v, fence[fs].e, fence[fs].a)
     fi;
     v = 0; fs = 0
  fi
}

#define NOOPEN (!slot[0].on && !slot[1].on && (NP < 2 || (!slot[NJ].on && !slot[NJ+1].on)))

inline saveFences() {
  vi = 0;
  do
  :: vi < NF -> savedFence[vi].e = fence[vi].e; savedFence[vi].a = fence[vi].a; savedFence[vi].setter = fence[vi].setter; vi++
  :: else -> break
  od;
  vi = 0
}

/* Once no forger can replay them, the positions up to the saved one are
 * never read again: clear them, so that they do not tell states apart. */
inline forgetSaved() {
  if
  :: !FAULT(nforge, MAXFORGE) ->
     vi = 0;
     do
     :: vi < savedPos ->
        log[vi].kind = 0; log[vi].f = 0; log[vi].e = 0; log[vi].a = 0; log[vi].j = 0;
        log[vi].k = 0; log[vi].idx = 0; log[vi].fin = 0; log[vi].prev = 0; vi++
     :: else -> break
     od;
     vi = 0
  :: else -> skip
  fi
}

inline restore() {
  pos = savedPos;
  vi = 0;
  do
  :: vi < NF -> fence[vi].e = savedFence[vi].e; fence[vi].a = savedFence[vi].a; fence[vi].setter = savedFence[vi].setter; vi++
  :: else -> break
  od;
  vi = 0;
  do
  :: vi < NP*NJ -> clearSlot(vi);
#ifdef WRITTEN_STATE
     memApplied[vi] = 0;
#endif
     vi++
  :: else -> break
  od;
  vi = 0
}

proctype Runner() {
  byte fs, v, vi, si, q;
#ifdef VARIANT_D
  /* the consumer: ccur is the last position delivered; a delivery may be
   * lost in flight and comes again as a redelivery, after later ones */
  byte ccur;
  bit dec[LOGMAX];
end:
  do
  :: atomic {
       ccur < llen -> ccur++;
       if
       :: FAULT(nloss, MAXLOSS) -> TAKE(nloss)  /* lost in flight */
       :: ccur >= lfirst && !dec[ccur - 1] -> decide(ccur - 1); dec[ccur - 1] = 1
       :: ccur < lfirst || dec[ccur - 1] -> skip
       fi
     }
  :: atomic {
       select (q : 1 .. LOGMAX);
       if
       :: q <= ccur && q >= lfirst && !dec[q - 1] -> decide(q - 1); dec[q - 1] = 1
       :: else -> skip
       fi;
       q = 0
     }
  :: d_step {
       pos < ccur && (dec[pos] || pos + 1 < lfirst) -> pos++
     }
  od
#else
end:
  do
  /* a batch: what the log holds, decided in order. After each decision the
   * runner saves (position, fences) before acking; the position never
   * passes an open attempt's first effect: it is saved when none is open.
   * (With -DONEBYONE a batch is one message.) */
  :: d_step {
       stopped == 0 && pos < llen ->
       do
       :: stopped == 0 && pos < llen && pos + 1 < lfirst ->
          /* positions trimmed before the runner saw them */
#ifdef VARIANT_A
          printf("MSC: sink skips positions %d..%d (trimmed)\n", pos + 1, lfirst - 1);
          pos = lfirst - 1       /* skipped */
#else
          stopped = GAP;         /* stop, never skip: an operator resumes it */
          printf("MSC: sink stops: positions after %d were trimmed\n", pos)
#endif
       :: stopped == 0 && pos < llen && pos + 1 >= lfirst ->
          decide(pos); pos++;
          if
          :: NOOPEN -> savedPos = pos; saveFences(); forgetSaved()
          :: else -> skip
          fi;
#ifdef ONEBYONE
          break
#else
          skip
#endif
       :: else -> break
       od
     }
  /* crash, and resume from what was saved */
  :: atomic { FAULT(nscrash, MAXSCRASH) -> TAKE(nscrash); printf("MSC: sink crashes; resumes after position %d\n", savedPos); restore() }
  od
#endif
}
