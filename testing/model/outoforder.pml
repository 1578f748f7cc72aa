/*
 * outoforder.pml: jobs of one lease that complete out of stream order.
 *
 * A worker with several jobs of a partition in flight completes them in any
 * order. It alone sends the finals, so their order on the subject is the
 * order it completed them: each final names in After the job that completed
 * before it on the subject in this lease, and carries as Floor the
 * worker's watermark when it is sent (every job of the lease up to it is
 * finished: its final acknowledged). A job is done once it and every job
 * completed before it in the lease are finished (done follows completion
 * order); progress commits the watermark and the jobs done above it (the
 * fence record's done set) in one compare-and-set, and a successor starts
 * after the watermark and skips the done set. An effect not acknowledged
 * rewinds: the jobs completed and not done are run again under higher
 * attempt numbers, the after map unwound in the reverse of the order their
 * finals were sent.
 *
 * The sink keeps per chain (fence, subject, lease) a floor F and the set A
 * of jobs applied above it: a final of job J is a duplicate if J <= F or J
 * in A, applies when After is 0, at or below F, or in A, and applying it
 * adds J to A. F is proven: the sink reads the fence record, then notes the
 * log's end S, and once it has decided the log up to S raises F to the
 * watermark the record shows for the chain's lease, but not to a job whose
 * final it holds (it may still apply). A final's Floor, and the job of a
 * final without one, raise nothing: anyone who can publish on the log with
 * the holder's stamp can claim them. A successor's barrier settles the
 * earlier lease: what it completed and whose After holds applies,
 * repeatedly; the rest is dropped. The destination dedupes by key.
 *
 * A forger (a credential that may publish on the log) copies the live
 * lease's stamp from its barrier and stores a final of a job of its choice
 * (the next job, or one far ahead: job NJ+1, which the worker never runs)
 * with After 0 and a Floor of its choice, or none.
 *
 * Two jobs of one effect each, both in flight; two leases (the second
 * takes over when the first expires or crashes, while the first may go on
 * as a zombie); faults: a publish lost or stored with its acknowledgement
 * lost, an expiry, a crash, a forged final. The check: every job the fence
 * record commits (at or below its watermark, or in its done set) is applied
 * once the sink has decided the whole log (I8), and no chain applies a job
 * twice. (A forged final of a job the worker runs is applied under that
 * job's key, and the worker's own final is then a duplicate: the residual
 * of a forgery of the holder's exact stamp. A forged final of job NJ+1 is
 * applied, and nothing else comes of it.)
 *
 * Switches that put a defect back (each must give a counterexample):
 *   TODAY_RULE   the sink's rule before floors: a job at or below the last
 *                applied one is a duplicate (a job completing after a later
 *                one is dropped)
 *   DONE_ON_ACK  a job is done once its own final is acknowledged, whatever
 *                completed before it (a successor re-runs the earlier job in
 *                its own lease and the later one's After never holds)
 *   NO_FLOOR     finals carry no Floor, and the sink's floor is the job
 *                applied (the sequential rule) under out-of-order completion
 *   TODAY_FLOOR  the sink's rule before proven floors: applying a final
 *                raises F to its Floor, or to its job for a final without
 *                one; a forged final passes a job still running, which is
 *                then a duplicate
 */

#define NJ 2
#define FAR (NJ + 1)    /* a job far ahead, which the worker never runs */
#define BIT(j) (1 << (j))
#define LOGMAX 13

#ifndef MAXFAULTS
#define MAXFAULTS 2
#endif
#ifndef MAXFORGE
#define MAXFORGE 1
#endif
#ifndef MAXREAD
#define MAXREAD 2
#endif
#define FAULT(c, max) (faults < MAXFAULTS && c < max)
#define TAKE(c) faults++; c++
byte faults, nloss, nexp, ncrash, nforge;

#if defined(NO_FLOOR) && !defined(TODAY_FLOOR)
#define TODAY_FLOOR
#endif
#if defined(TODAY_RULE) && !defined(TODAY_FLOOR)
#define TODAY_FLOOR
#endif

/* the fence record: the epoch that fenced it, its watermark and done set */
byte recE, recSeq, recDone;

/* the effect log */
#define BARRIER 1
#define FINAL   2
typedef Msg {
  byte kind;
  byte e;       /* the lease's epoch */
  byte j;       /* the job */
  byte k;       /* the attempt */
  byte after;   /* Leasehold-After */
  byte floor;   /* Leasehold-Floor */
  bit floored   /* the final carries a floor */
}
Msg log[LOGMAX];
byte llen;

inline append(K, E, J, KK, AFTER, FLOOR, FLOORED) {
  assert(llen < LOGMAX);
  printf("MSC: log %d: kind %d epoch %d job %d attempt %d after %d floor %d (%d)\n", llen + 1, K, E, J, KK, AFTER, FLOOR, FLOORED);
  log[llen].kind = K; log[llen].e = E; log[llen].j = J; log[llen].k = KK;
  log[llen].after = AFTER; log[llen].floor = FLOOR; log[llen].floored = FLOORED;
  llen++
}

/* an async publish: stored and acknowledged, stored with its ack lost, or lost */
inline publish(E, J, KK, AFTER, FLOOR, FLOORED, res) {
  if
  :: append(FINAL, E, J, KK, AFTER, FLOOR, FLOORED); res = 1
  :: FAULT(nloss, 1) -> TAKE(nloss); append(FINAL, E, J, KK, AFTER, FLOOR, FLOORED); res = 0;
     printf("MSC: (its acknowledgement is lost)\n")
  :: FAULT(nloss, 1) -> TAKE(nloss); res = 0;
     printf("MSC: the final of job %d is lost\n", J)
  fi
}

bit expired;            /* lease 1 is gone: lease 2 may take over */
byte wended;            /* workers that ended */
byte liveE;             /* the epoch of the last barrier in the log: the live lease's stamp */

#define IDLE 0
#define RUNNING 1
#define COMPLETED 2
#define DONE 3

#ifdef NO_FLOOR
#define FLOORS 0
#else
#define FLOORS 1
#endif

proctype Worker(byte e) {
  byte W, done, after, att, i, j, nwin;
  byte st[NJ+1];
  byte undo[NJ+1];
  bit ok[NJ+1];
  byte win[NJ];
  bit res;

  if
  :: e == 1
  :: e == 2 && expired
  :: e == 2 && wended == 1 && !expired -> goto end  /* lease 1 finished: nothing to take over */
  fi;
  /* fence the record: only an epoch above the recorded one may */
  atomic {
    if
    :: recE < e -> recE = e; W = recSeq; done = recDone;
       printf("MSC: lease %d fences the record: watermark %d, done %d\n", e, W, done)
    :: else -> goto end
    fi;
    j = 1;
    do
    :: j <= NJ -> if :: j <= W || (done & BIT(j)) -> st[j] = DONE :: else fi; j++
    :: j > NJ -> break
    od;
    j = 0;
    append(BARRIER, e, 0, 0, 0, 0, 0);
    liveE = e
  };
  do
  /* start a job: any job not done, none running of it */
  :: atomic { st[1] == IDLE -> st[1] = RUNNING }
  :: atomic { st[2] == IDLE -> st[2] = RUNNING }
  /* a handler returns: the runner sends its final, After the job that
   * completed before it on the subject, Floor its watermark */
  :: atomic {
       (st[1] == RUNNING || st[2] == RUNNING) ->
       if
       :: st[1] == RUNNING -> j = 1
       :: st[2] == RUNNING -> j = 2
       fi;
       att++;
       publish(e, j, att, after, W * FLOORS, FLOORS, res);
       ok[j] = res; res = 0;
       undo[j] = after; after = j;
       win[nwin] = j; nwin++;
       st[j] = COMPLETED; j = 0
     }
  /* reap: a job is done once its final is acknowledged and so is every
   * job completed before it */
  :: atomic {
#ifdef DONE_ON_ACK
       nwin > 0 && (ok[win[0]] || nwin > 1 && ok[win[1]]) ->
       if
       :: ok[win[0]] -> i = 0
       :: nwin > 1 && ok[win[1]] -> i = 1
       fi;
#else
       nwin > 0 && ok[win[0]] -> i = 0;
#endif
       j = win[i]; st[j] = DONE; done = done | BIT(j); ok[j] = 0;
       if
       :: i == 0 && nwin > 1 -> win[0] = win[1]
       :: else
       fi;
       nwin--; win[nwin] = 0;
       do
       :: W < NJ && (done & BIT(W + 1)) -> W++; done = done & ~BIT(W)
       :: else -> break
       od;
       i = 0; j = 0
     }
  /* an effect not acknowledged: stop, let running jobs end unsent, unwind
   * the after map in reverse, run the jobs not done again */
  :: atomic {
       nwin > 0 && !ok[win[0]] ->
       printf("MSC: lease %d rewinds from job %d\n", e, win[0]);
       do
       :: nwin > 0 -> nwin--; after = undo[win[nwin]]; st[win[nwin]] = IDLE; ok[win[nwin]] = 0; win[nwin] = 0
       :: else -> break
       od;
       if :: st[1] == RUNNING -> st[1] = IDLE :: else fi;
       if :: st[2] == RUNNING -> st[2] = IDLE :: else fi
     }
  /* commit: a compare-and-set on the record, refused once a successor
   * fenced it */
  :: atomic {
       recE == e && (recSeq != W || recDone != done) ->
       recSeq = W; recDone = done;
       printf("MSC: lease %d commits watermark %d, done %d\n", e, W, done)
     }
  :: atomic { recE != e -> goto end }      /* the commit is refused: stop */
  :: atomic { recE == e && W == NJ && recSeq == NJ -> goto end }
  /* faults: the lease expires under its holder, which goes on as a zombie,
   * or the holder crashes */
  :: atomic { e == 1 && !expired && FAULT(nexp, 1) -> TAKE(nexp); expired = 1;
       printf("MSC: lease 1 expires; its holder goes on\n") }
  :: atomic { e == 1 && !expired && FAULT(ncrash, 1) -> TAKE(ncrash); expired = 1;
       printf("MSC: the holder of lease 1 crashes\n"); goto end }
  od;
end:
  atomic { wended++ }
}

/* ---------------------------------------------------------------- sink */
byte fE;                    /* the fence: the highest barrier's epoch */
byte cE, F, A;              /* the chain of lease cE: floor, applied set */
#define NPEND 5
byte pj[NPEND], pafter[NPEND], pfloor[NPEND], pk[NPEND];
bit pfl[NPEND];
bit appliedKey[FAR+1];      /* the destination, deduping by key */
byte chainApplied[FAR+1];   /* applications of the current chain */
/* reads of the fence record */
byte rdSeq, nread;

#ifdef TODAY_RULE
#define DUP(j) ((j) <= F)
#define HOLDS(x) ((x) <= F)
#else
#define DUP(j) ((j) <= F || (A & BIT(j)))
#define HOLDS(x) ((x) == 0 || (x) <= F || (A & BIT(x)))
#endif

/* ------------------------------------------------------------- forger */
/* A final of the next job or of one far ahead, After 0, with a Floor of
 * its choice below its job, or none, under the live lease's stamp. */
active proctype Forger() {
end:
  do
  :: atomic {
       liveE > 0 && wended < 2 && FAULT(nforge, MAXFORGE) -> TAKE(nforge);
       printf("MSC: a forger stores a final under lease %d\n", liveE);
       if
       :: append(FINAL, liveE, 2, 9, 0, 0, 0)
       :: append(FINAL, liveE, 2, 9, 0, 1, 1)
       :: append(FINAL, liveE, FAR, 9, 0, 0, 0)
       :: append(FINAL, liveE, FAR, 9, 0, 1, 1)
       :: append(FINAL, liveE, FAR, 9, 0, 2, 1)
       fi
     }
  od
}

/* what A holds at or below F leaves it */
inline dropBelowF() {
  r = 1;
  do
  :: r <= F -> A = A & ~BIT(r); r++
  :: else -> break
  od;
  r = 0
}

/* apply the held finals of the chain whose After holds, until none does */
inline applyReady() {
  q = 0;
  do
  :: q < NPEND && pj[q] != 0 && DUP(pj[q]) ->
     printf("MSC: sink drops the final of job %d attempt %d: a duplicate\n", pj[q], pk[q]);
     pj[q] = 0; q = 0
  :: q < NPEND && pj[q] != 0 && !DUP(pj[q]) && HOLDS(pafter[q]) ->
     printf("MSC: sink applies job %d attempt %d of lease %d\n", pj[q], pk[q], cE);
     appliedKey[pj[q]] = 1;
     chainApplied[pj[q]]++;
     assert(chainApplied[pj[q]] == 1);
#ifdef TODAY_RULE
     F = pj[q];
#else
     A = A | BIT(pj[q]);
#ifdef TODAY_FLOOR
     if
     :: pfl[q] && pfloor[q] > F -> F = pfloor[q]
     :: !pfl[q] && pj[q] > F -> F = pj[q]
     :: else
     fi;
     dropBelowF();
#endif
#endif
     pj[q] = 0; q = 0
  :: q < NPEND && (pj[q] == 0 || !DUP(pj[q]) && !HOLDS(pafter[q])) -> q++
  :: q == NPEND -> break
  od;
  q = 0
}

active proctype Sink() {
  byte p, q, r;
  do
#ifndef TODAY_FLOOR
  /* read the fence record once the whole log is decided (so the log's end,
   * noted after the read, is where the sink stands): it proves the floor of
   * its lease's chain, but not past a job whose final the sink holds */
  :: atomic {
       p == llen && nread < MAXREAD && recE == cE && recSeq > F ->
       nread++; rdSeq = recSeq;
       q = 0;
       do
       :: q < NPEND -> if :: pj[q] != 0 && pj[q] <= rdSeq -> rdSeq = pj[q] - 1 :: else fi; q++
       :: else -> break
       od;
       q = 0;
       if
       :: rdSeq > F -> F = rdSeq; printf("MSC: sink proves floor %d of lease %d\n", F, cE); dropBelowF(); applyReady()
       :: else
       fi;
       rdSeq = 0
     }
#endif
  :: atomic {
       p < llen ->
       if
       :: log[p].kind == BARRIER && log[p].e > fE ->
          /* a successor settles the earlier lease: what applies, applies */
          applyReady();
          q = 0;
          do
          :: q < NPEND -> if :: pj[q] != 0 -> printf("MSC: sink drops job %d of lease %d at the barrier\n", pj[q], cE) :: else fi; pj[q] = 0; q++
          :: else -> break
          od;
          q = 0;
          fE = log[p].e; cE = fE; F = 0; A = 0; chainApplied[1] = 0; chainApplied[2] = 0; chainApplied[FAR] = 0
       :: log[p].kind == FINAL && log[p].e < fE ->
          printf("MSC: sink refuses job %d of epoch %d: stale\n", log[p].j, log[p].e)
       :: log[p].kind == FINAL && log[p].e == fE ->
          q = 0;
          do
          :: q < NPEND && pj[q] != 0 -> q++
          :: q < NPEND && pj[q] == 0 -> break
          :: q == NPEND -> assert(false)
          od;
          pj[q] = log[p].j; pk[q] = log[p].k; pafter[q] = log[p].after; pfloor[q] = log[p].floor; pfl[q] = log[p].floored;
          applyReady()
       :: else
       fi;
       p++
     }
  :: atomic {
       p == llen && wended == 2 ->
       /* I8: every job the record commits is applied */
       assert(recSeq < 1 && !(recDone & BIT(1)) || appliedKey[1]);
       assert(recSeq < 2 && !(recDone & BIT(2)) || appliedKey[2]);
       break
     }
  od
}

init {
  atomic { run Worker(1); run Worker(2) }
}
