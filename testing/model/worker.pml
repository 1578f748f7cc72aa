/*
 * worker.pml: a worker (coordinator + worker SDK). It takes a free fence,
 * fences its record, writes its barrier, then handles jobs (a partition) or
 * writes once (the lock). A pause is any wait between two steps: the model
 * may run every other process meanwhile, and a paused worker then goes on
 * with its old epoch. A crash (at any step of an acquisition) forgets
 * everything local; the worker then starts again as a new incarnation.
 */

/* an async publish: stored and acknowledged, stored with its ack lost, or
 * lost; res says whether the worker saw it acknowledged */
inline publish(K, F, E, A, J, KK, I, FIN, PREV, res) {
  if
  :: append(K, F, E, A, J, KK, I, FIN, PREV); res = 1
  :: FAULT(nloss, MAXLOSS) -> TAKE(nloss); append(K, F, E, A, J, KK, I, FIN, PREV); res = 0;
     printf("MSC: (its acknowledgement is lost)\n")
  :: FAULT(nloss, MAXLOSS) -> TAKE(nloss); res = 0;
     printf("MSC: a publish (kind %d job %d) is lost\n", K, J)
  fi
}

/* the second effect of an attempt: its Nats-Msg-Id (key@epoch + the
 * attempt's nonce) can be read off the first one, so a forger may store
 * something under it first. The stream then drops the worker's message
 * and answers Duplicate=true. */
inline publishSecond(F, E, A, J, KK, PREV, res) {
  if
  :: publish(EFFECT, F, E, A, J, KK, 1, 1, PREV, res)
  :: FAULT(nforge, MAXFORGE) -> TAKE(nforge);
     printf("MSC: a forger stores garbage under the Nats-Msg-Id of the next effect\n");
     append(GARBAGE, F, 0, 0, 0, 0, 0, 0, 0);
#ifdef VARIANT_E
     res = 1    /* trusted: the worker believes its effect stored */
#else
     res = 0    /* read back: the stored message is not this one, the attempt fails */
#endif
  fi
}

/* purge the lease if the key's last write is still the acquiring one: a
 * compare-and-set on the revision, as Lease.Release does */
inline release() {
  if
  :: lease[f].live && lease[f].rev == e ->
     assert(counter < 31); counter++; LASTWRITE(f);
     lease[f].live = 0; lease[f].rev = counter; lease[f].acq = 0
  :: else -> skip
  fi
}

inline forget() {
  f = 0; e = 0; a = 0; prog = 0; fin = 0; nxt = 0; start = 0; res = 0; res0 = 0;
  att[1] = 0; att[2] = 0; ok[1] = 0; ok[2] = 0; lost = 0
}

#define CRASH atomic { FAULT(ncrash, MAXCRASH) -> TAKE(ncrash); goto crashed }

/* the final names the previous job handled in this epoch, if any */
inline setPrev() {
  if
  :: nxt > start -> pv = nxt - 1
  :: else -> pv = 0
  fi
}

inline acquire() {
  assert(counter < 31); counter++; nacq++; nacqf[f]++; LASTWRITE(f);
  lease[f].live = 1; lease[f].rev = counter; lease[f].acq = nacq;
  e = counter; a = nacq; acqEpoch[a] = e; acqFence[a] = f;
  held[w] = a;
  printf("MSC: worker %d acquires fence %d: epoch %d acquisition %d\n", w, f, e, a)
}

proctype Worker(byte w) {
  byte f, e, a, prog, fin, nxt, start, pv;
  byte att[NJ+1];
  bit ok[NJ+1];
  bit res, res0, lost;

idle:
  do
  :: atomic { ALLDONE -> wended++; break }
  /* Acquire: create the lease key over an empty key or a marker. The
   * revision of this write is the epoch; the acquisition gets a token of
   * its own. (coordinator/acquire.go acquireKey) */
  :: atomic {
       if
       :: LOCKGATE && ACQOK(0) && !lease[0].live && WANT(0) -> f = 0
       :: LOCKGATE && NP > 1 && ACQOK(1) && !lease[1].live && WANT(1) -> f = 1
#ifdef LOCKSTEPS
       :: ACQOK(LOCKF) && !lease[LOCKF].live && WANT(LOCKF) -> f = LOCKF
#endif
       fi;
       acquire()
     };
     goto fencing
#if !defined(LOCKSTEPS) && !defined(LOCKFIRST)
  /* The lock, in one step: acquired, fenced, its barrier and its one write
   * (no job headers: it applies on its own) published, released. With
   * -DLOCKSTEPS these are steps of their own, as for a partition. */
  :: atomic {
       ACQOK(LOCKF) && !lease[LOCKF].live && WANT(LOCKF) ->
       f = LOCKF; acquire();
       if
       :: frec[f].e < e ->
          frec[f].e = e; frec[f].a = a; fenced[f] = fenced[f] | (1 << a);
          append(BARRIER, f, e, a, 0, 0, 0, 0, 0); append(EFFECT, f, e, a, 0, 0, 0, 1, 0);
          lockDone = 1
       :: else -> skip
       fi;
       release(); held[w] = 0; forget()
     }
#endif
  od;
  goto finished;

fencing:
  /* Fence the record: a compare-and-set to (e, a) that only an epoch above
   * the recorded one may make. (coordinator/progress.go fenceProgress;
   * target: the <bucket>-fences record) */
  if
  :: CRASH
  :: atomic {
       if
       :: frec[f].e < e ->
          frec[f].e = e; frec[f].a = a; fenced[f] = fenced[f] | (1 << a); prog = frec[f].seq;
          printf("MSC: worker %d fences record %d at epoch %d acquisition %d, progress %d\n", w, f, e, a, prog)
#ifdef TODAY_PROGRESS
       :: frec[f].e == e ->
          /* "an earlier attempt of ours landed": taken as our own.
           * I2: one acquisition per epoch holds the record */
          assert(frec[f].a == a);
          fenced[f] = fenced[f] | (1 << a); prog = frec[f].seq
#endif
       :: else -> lost = 1;    /* a later epoch, or this epoch for another acquisition */
          printf("MSC: worker %d: fence record %d refuses epoch %d acquisition %d (it holds %d/%d)\n", w, f, e, a, frec[f].e, frec[f].a)
       fi
     }
  fi;
  if
  :: lost -> atomic { release(); held[w] = 0; forget(); goto idle }
  :: else
  fi;
  /* Barrier: published and acknowledged before the first job or write.
   * (worker/barrier.go writeBarriers) A lock holder then makes its one
   * write (no job headers: it applies on its own) and releases the lock,
   * all in one step. */
  if
  :: CRASH
  :: f == LOCKF ->
     atomic {
       append(BARRIER, f, e, a, 0, 0, 0, 0, 0); append(EFFECT, f, e, a, 0, 0, 0, 1, 0);
       release(); lockDone = 1; held[w] = 0; forget(); goto idle
     }
  :: f != LOCKF -> d_step { append(BARRIER, f, e, a, 0, 0, 0, 0, 0) }
  fi;
  d_step { fin = prog; nxt = prog + 1; start = prog + 1 };
  do
  :: CRASH
  :: atomic { prog == NJ -> held[w] = 0; forget(); goto idle }  /* nothing left */
  /* handle job nxt (worker/partition.go runJob; target: the last effect is
   * held until the handler returns, then sent final) */
  :: atomic {
       nxt <= NJ && nxt <= fin + WINDOW && NE(nxt) == 2 ->
       assert(att[nxt] < 3); att[nxt]++;
       publish(EFFECT, f, e, a, nxt, att[nxt], 0, 0, 0, res0)
     };
     if
     :: CRASH
     :: atomic {
          if
          :: FAULT(nhfail, MAXHFAIL) -> TAKE(nhfail);
             printf("MSC: worker %d: the handler of job %d fails\n", w, nxt);
             /* the handler failed after emitting: abort marker, run it again */
             publish(ABORT, f, e, a, nxt, att[nxt], 0, 0, 0, res);
             res = 0; res0 = 0
          :: skip ->     /* it returned: the held effect goes out, final */
             setPrev(); publishSecond(f, e, a, nxt, att[nxt], pv, res); pv = 0;
             ok[nxt] = res0 && res; res = 0; res0 = 0; nxt++
          fi
        }
     fi
  :: atomic {
       nxt <= NJ && nxt <= fin + WINDOW && NE(nxt) == 1 ->
       assert(att[nxt] < 3); att[nxt]++;
       setPrev(); publish(EFFECT, f, e, a, nxt, att[nxt], 0, 1, pv, res); pv = 0;
       ok[nxt] = res; res = 0; nxt++
     }
  /* reap the oldest job, finished once every effect is acknowledged
   * (worker/progress.go reap), and commit it: a compare-and-set on the
   * fence record (coordinator/progress.go Commit) */
  :: atomic {
       fin + 1 < nxt && ok[fin + 1] -> fin++; ok[fin] = 0;
       if
       :: frec[f].e == e && frec[f].a == a -> frec[f].seq = fin; prog = fin;
          printf("MSC: worker %d commits job %d of fence %d (epoch %d)\n", w, fin, f, e)
#ifdef TODAY_PROGRESS
       :: frec[f].e == e && frec[f].a != a ->
          /* the read-back finds "its" epoch and takes the record over */
          if
          :: frec[f].seq < fin -> frec[f].seq = fin
          :: else -> skip
          fi;
          prog = fin
#endif
       :: else ->
          /* refused: a successor fenced the record; give the key back if
           * it is still ours */
          printf("MSC: worker %d: commit of job %d refused (epoch %d)\n", w, fin, e);
          release(); held[w] = 0; forget(); goto idle
       fi;
       if
       :: prog == NJ -> held[w] = 0; forget(); goto idle  /* done; the lease is kept */
       :: else -> skip
       fi
     }
  /* an effect not acknowledged: run again from this job, under higher
   * attempt numbers, with no abort marker (worker/progress.go rewind) */
  :: atomic {
       fin + 1 < nxt && !ok[fin + 1] ->
       ok[1] = 0; ok[2] = 0; nxt = fin + 1
     }
  od;

crashed:
  /* a crash: everything local is gone; the lease stays until it expires */
  atomic { printf("MSC: worker %d crashes\n", w); held[w] = 0; forget(); goto idle };

finished:
  skip
}

#ifdef LOCKFIRST
/* With -DLOCKFIRST the lock is taken, fenced, written (its barrier and its
 * one write) and released before any partition is acquired, in one step:
 * its epoch then does not shift every partition epoch after it, nor its
 * messages every log position, which keeps the state space small. */
proctype Locker() {
  byte f = LOCKF, e, a;
  atomic {
    assert(counter < 31); counter++; nacq++; nacqf[f]++; LASTWRITE(f);
    lease[f].live = 1; lease[f].rev = counter; lease[f].acq = nacq;
    e = counter; a = nacq; acqEpoch[a] = e; acqFence[a] = f;
    frec[f].e = e; frec[f].a = a; fenced[f] = fenced[f] | (1 << a);
    append(BARRIER, f, e, a, 0, 0, 0, 0, 0); append(EFFECT, f, e, a, 0, 0, 0, 1, 0);
    release(); lockDone = 1; f = 0; e = 0; a = 0
  }
}
#endif
