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

/* Apply job jj of fence ff from attempt rk: every effect in one step, each
 * key once (dedupe by scope and key). */
inline applyJob(ff, jj, rk) {
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
  printf("MSC: sink applies job %d of fence %d (epoch %d acquisition %d attempt %d)\n", jj, ff, slot[si].e, slot[si].a, rk);
#ifdef WRITTEN_STATE
  memApplied[si] = 1;
#endif
  clearSlot(si)
}

#ifdef TODAY_MARKERS
/* the open attempt (one at a time), if complete and the job its final
 * names as previous is applied */
inline tryApply(ff, jj) {
  si = SI(ff, jj);
  kk = 1;
  do
  :: kk <= 3 && !ON(si, kk) -> kk++
  :: else -> break
  od;
  if
  :: kk <= 3 && COMPLETE(si, kk, jj) && (PRV(si, kk) == 0 || PREVAPPLIED(ff, PRV(si, kk))) -> applyJob(ff, jj, kk)
  :: else -> skip
  fi;
  kk = 0; si = 0
}
#else
/* Apply job jj of fence ff from the first attempt, by rank, that is complete
 * and whose previous job is applied; an attempt ranked before it that may
 * still complete holds it back. Rank: attempts in number order, one that
 * came after a higher one (late) after those (the order they first came
 * in, with one forgery). A disputed attempt (its abort and its final both
 * came) waits for the record, and then gives way to a complete attempt
 * ranked after it. A complete attempt whose previous job can never apply
 * (hopeless: with two jobs, job 1 settled, not applied, with no complete
 * attempt) is passed over. (sink/streamsink/attempts.go candidate) */
inline tryApply(ff, jj) {
  si = SI(ff, jj);
  rk = 0; pass = 0;
  do
  :: pass < 2 && rk == 0 ->
     kk = 1;
     do
     :: kk <= 3 && rk == 0 ->
        if
        :: ON(si, kk) && LATEK(si, kk) == pass ->
           if
           :: !COMPLETE(si, kk, jj) -> rk = NONE         /* may still complete: wait */
           :: else ->
              /* lc: a complete attempt ranks after this one */
              lc = 0; k2 = 1;
              do
              :: k2 <= 3 ->
                 if
                 :: COMPLETE(si, k2, jj) && (LATEK(si, k2) > pass || (LATEK(si, k2) == pass && k2 > kk)) -> lc = 1
                 :: else -> skip
                 fi;
                 k2++
              :: else -> break
              od;
              k2 = 0;
              if
              :: ABK(si, kk) && !SETTLED(ff, slot[si].e, slot[si].a, jj) -> rk = NONE   /* disputed: wait */
              :: ABK(si, kk) && SETTLED(ff, slot[si].e, slot[si].a, jj) && lc -> skip  /* gives way */
              :: else ->
                 if
                 :: PRV(si, kk) == 0 || PREVAPPLIED(ff, PRV(si, kk)) -> rk = kk
                 :: else ->
                    if
                    :: jj == 2 && PRV(si, kk) == 1 && SETTLED(ff, slot[si].e, slot[si].a, jj) &&
                       !PREVAPPLIED(ff, 1) && !ANYCOMPLETE(SI(ff, 1), 1) -> skip   /* hopeless */
                    :: else -> rk = NONE
                    fi
                 fi
              fi;
              lc = 0
           fi
        :: else -> skip
        fi;
        kk++
     :: else -> break
     od;
     pass++
  :: else -> break
  od;
  if
  :: rk != 0 && rk != NONE -> applyJob(ff, jj, rk)
  :: else -> skip
  fi;
  rk = 0; pass = 0; kk = 0; si = 0
}
#endif

inline clearSlot(s) {
  slot[s].on = 0; slot[s].e = 0; slot[s].a = 0; slot[s].fin = 0; slot[s].ab = 0; slot[s].late = 0; slot[s].got = 0; slot[s].prev = 0
}

/* drop the attempt k of slot s (all its bits) */
inline clearAttempt(s, k) {
  slot[s].on = slot[s].on & ~BIT(k); slot[s].fin = slot[s].fin & ~BIT(k);
  slot[s].ab = slot[s].ab & ~BIT(k); slot[s].late = slot[s].late & ~BIT(k);
  slot[s].got = slot[s].got & ~(3 << (2*((k) - 1))); slot[s].prev = slot[s].prev & ~(3 << (2*((k) - 1)));
  if
  :: slot[s].on == 0 -> clearSlot(s)
  :: else -> skip
  fi
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
  kk = log[p].k;
  if
#ifndef WRITTEN_REOPEN
  :: jobApplied[si] -> skip   /* a job applied already: a duplicate, acked and dropped */
#endif
#ifdef TODAY_MARKERS
  :: slot[si].on && slot[si].e == log[p].e && slot[si].a == log[p].a && (slot[si].on >> kk) != 0 ->
     skip                     /* an earlier attempt, superseded */
  :: else ->
     if
     :: slot[si].on && slot[si].e == log[p].e && slot[si].a == log[p].a && ON(si, kk) -> skip
     :: else ->                /* a new attempt supersedes an open one */
        clearSlot(si);
        slot[si].e = log[p].e; slot[si].a = log[p].a; slot[si].on = BIT(kk)
     fi;
#else
  :: !ON(si, kk) && log[p].f < NP && (p + 1) > pS && SETTLED(log[p].f, log[p].e, log[p].a, log[p].j) ->
     skip                     /* after the lease's commits were all read: set aside (after_commit) */
  :: else ->
     if
     :: slot[si].on && (slot[si].e != log[p].e || slot[si].a != log[p].a) -> clearSlot(si)
     :: else -> skip
     fi;
     if
     :: !ON(si, kk) ->
        slot[si].e = log[p].e; slot[si].a = log[p].a;
        if
        :: (slot[si].on >> kk) != 0 -> slot[si].late = slot[si].late | BIT(kk)   /* attempt_order */
        :: else -> skip
        fi;
        slot[si].on = slot[si].on | BIT(kk)
     :: else -> skip
     fi;
#endif
     if
     :: log[p].fin && !FINK(si, kk) && !((GOT(si, kk) >> log[p].idx) & 1) ->
        slot[si].fin = slot[si].fin | BIT(kk);
        slot[si].prev = (slot[si].prev & ~(3 << (2*(kk - 1)))) | (log[p].prev << (2*(kk - 1)))
     :: else -> skip           /* not a final, or a final that repeats a key or a final (final_key, final_conflict) */
     fi;
     slot[si].got = slot[si].got | (1 << (2*(kk - 1) + log[p].idx));
     tryApply(log[p].f, 1);
     tryApply(log[p].f, 2)
  fi;
  kk = 0;
#endif
  si = 0
}

/* an admitted abort marker */
inline onAbort(p) {
  si = SI(log[p].f, log[p].j);
  kk = log[p].k;
  if
#ifdef TODAY_MARKERS
  /* closes the open attempt at or below its number */
  :: slot[si].on && slot[si].e == log[p].e && slot[si].a == log[p].a && (slot[si].on & ((1 << kk) - 1)) != 0 -> clearSlot(si)
#else
  /* a hint on its own attempt: it proves nothing */
  :: slot[si].on && slot[si].e == log[p].e && slot[si].a == log[p].a && ON(si, kk) -> slot[si].ab = slot[si].ab | BIT(kk)
#endif
  :: else -> skip
  fi;
  kk = 0; si = 0
}

#ifndef TODAY_MARKERS
/* a read of the records now would settle an open attempt's job */
#define NOWSETTLED(s) (slot[s].on && ((frec[(s)/NJ].e > slot[s].e) || (frec[(s)/NJ].e == slot[s].e && frec[(s)/NJ].a != slot[s].a) || (frec[(s)/NJ].e == slot[s].e && frec[(s)/NJ].a == slot[s].a && frec[(s)/NJ].seq >= (s)%NJ + 1)))
#define USEFUL (NOWSETTLED(0) || NOWSETTLED(1) || (NP > 1 && (NOWSETTLED(NJ) || NOWSETTLED(NJ+1))))
inline forgetProof() {
  ps = 0; pS = 0;
  q = 0;
  do
  :: q < NP -> pE[q] = 0; pA[q] = 0; pSeq[q] = 0; q++
  :: else -> break
  od;
  q = 0
}

/* The record read shows attempts that can never complete: those of a job
 * the lease commits no more of, still incomplete once the runner has
 * decided the log up to where it ended when the record was read. */
inline applyProof() {
  vi = 0;
  do
  :: vi < NP*NJ ->
     if
     :: slot[vi].on && SETTLED(vi / NJ, slot[vi].e, slot[vi].a, vi % NJ + 1) ->
        kk = 1;
        do
        :: kk <= 3 ->
           if
           :: ON(vi, kk) && !COMPLETE(vi, kk, vi % NJ + 1) -> clearAttempt(vi, kk)
           :: else -> skip
           fi;
           kk++
        :: else -> break
        od;
        kk = 0
     :: else -> skip
     fi;
     vi++
  :: else -> break
  od;
  vi = 0;
  q = 0;
  do
  :: q < NP -> tryApply(q, 1); tryApply(q, 2); q++
  :: else -> break
  od;
  q = 0
}
#endif

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
#ifndef TODAY_MARKERS
           /* the later lease fenced the record before it wrote this: the
            * earlier leases are settled as of here. What they completed
            * applies, under the fence as it stood (sink/streamsink/groups.go
            * abandon) */
           if
           :: log[p].f < NP -> rz = log[p].e; applyProof(); rz = 0
           :: else -> skip
           fi;
#endif
           /* the fence rises at this position; open attempts below it are
            * abandoned (what they did not complete never will: see README) */
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
        :: log[p].kind == ABORT -> onAbort(p)
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

#ifdef TODAY_MARKERS
#define FORGETPROOF skip
#else
#define FORGETPROOF forgetProof()
#endif

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
  vi = 0;
#ifndef TODAY_MARKERS
  /* what it read of the records is gone with it */
  ps = 0; pS = 0;
  do
  :: vi < NP -> pE[vi] = 0; pA[vi] = 0; pSeq[vi] = 0; vi++
  :: else -> break
  od;
  vi = 0
#endif
}

proctype Runner() {
  byte fs, v, vi, si, q, kk, rk, pass, lc, k2;
  byte rz;   /* while a raise to epoch rz settles the leases below it */
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
          :: NOOPEN -> savedPos = pos; saveFences(); forgetSaved(); FORGETPROOF
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
#ifndef TODAY_MARKERS
  /* read the fence records while attempts are open, note the log's last
   * position, and (decided up to it) drop what can never complete and
   * apply what that lets apply */
  :: atomic {
       stopped == 0 && pos == llen && USEFUL && !(ps == 2 && PROOFNOW) ->
       ps = 2; pS = llen;
       q = 0;
       do
       :: q < NP -> pE[q] = frec[q].e; pA[q] = frec[q].a; pSeq[q] = frec[q].seq; q++
       :: else -> break
       od;
       q = 0;
       printf("MSC: sink reads the fence record: %d/%d committed %d, the log ends at %d\n", pE[0], pA[0], pSeq[0], pS);
       applyProof();
       if
       :: NOOPEN -> savedPos = pos; saveFences(); forgetSaved(); forgetProof()
       :: else -> skip
       fi
     }
#endif
  /* crash, and resume from what was saved */
  :: atomic { FAULT(nscrash, MAXSCRASH) -> TAKE(nscrash); printf("MSC: sink crashes; resumes after position %d\n", savedPos); restore() }
  od
#endif
}
