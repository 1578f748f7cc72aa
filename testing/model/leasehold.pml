/*
 * leasehold.pml: leasehold's fencing protocol, with the parts still to be
 * built and the fixes the model found (see README.md), in Promela, for SPIN.
 *
 *   spin -a leasehold.pml && gcc -O2 -DSAFETY -o pan pan.c && ./pan
 *
 * Fences (FenceID{Scope, Partition}): 0 .. NP-1 are the partitions of one
 * job stream, LOCKF is a named lock kept in the same lease bucket, so its
 * epochs come from the same revision counter. One effect log, shared by
 * both scopes, feeds one deduping sink runner.
 *
 * Switches put a known defect back (each must give a counterexample):
 *   VARIANT_A  the runner skips a trimmed gap
 *   VARIANT_B  fences keyed by partition alone (the lock shares partition 0's)
 *   VARIANT_C  an unverified epoch raises a fence
 *   VARIANT_D  deliveries decided as they come, a redelivery against the
 *              current fence rather than the fence at its log position
 *   VARIANT_E  a PubAck with Duplicate=true trusted without reading the log
 *   VARIANT_F  equal epochs admitted whatever their acquisition
 *   VARIANT_G  effects applied one by one (no all-or-none per attempt)
 * and the target design as written, where the model found it wanting:
 *   WRITTEN_LEASE_TOKEN  stamps carry the lease record's token, and an epoch
 *                        verifies against the lease key's current record
 *   WRITTEN_RECENT       the fence record keeps one recent epoch; an epoch
 *                        it no longer holds is refused as unverified
 *   WRITTEN_STATE        saved state is position + fences (+ open jobs):
 *                        which job was applied last is not kept
 *   WRITTEN_REOPEN       an effect of a job already applied opens an attempt
 *   TODAY_PROGRESS       the progress record is fenced and committed on the
 *                        epoch alone (coordinator/progress.go before it
 *                        compared the acquisition)
 *   TODAY_VERIFY         an epoch verifies if it is at or below the highest
 *                        the fence record holds, whatever its acquisition
 *                        (sink.EpochCheck against Bucket.IssuedEpoch today)
 *   TODAY_MARKERS        job markers trusted, as the runner took them before
 *                        it read committed progress: an abort closes the
 *                        open attempt at or below its number, a higher
 *                        attempt supersedes a lower open one
 */

#ifdef WRITTEN_REOPEN
/* found when markers were trusted (see README, finding 4) */
#define TODAY_MARKERS
#endif

/* ------------------------------------------------------------ sizes */
#ifndef NW
#define NW 2            /* workers */
#endif
#ifndef NP
#define NP 1            /* partitions of the job stream */
#endif
#define NF (NP+1)       /* fences: the partitions, then the lock */
#define LOCKF NP
#define NJ 2            /* jobs per partition: job 1 has two effects, job 2 one */
#define NE(j) ((j) == 1 -> 2 : 1)
#define FULL(j) ((j) == 1 -> 3 : 1)
#ifndef WINDOW
#define WINDOW 2        /* jobs handled before the oldest is acknowledged */
#endif

/* fault budgets: MAXFAULTS in all, and at most one of a kind unless raised */
#ifndef MAXFAULTS
#define MAXFAULTS 2
#endif
#ifndef MAXEXP
#define MAXEXP 1        /* a lease expires under a live holder (pause, partition) */
#endif
#ifndef MAXCRASH
#define MAXCRASH 1      /* a worker crashes */
#endif
#ifndef MAXRB
#define MAXRB 1         /* the lease bucket loses its last write */
#endif
#ifndef MAXREC
#define MAXREC 0        /* the lease bucket is deleted and re-created */
#endif
#ifndef MAXLOSS
#define MAXLOSS 1       /* an async publish is lost, or stored with its ack lost */
#endif
#ifndef MAXHFAIL
#define MAXHFAIL 1      /* a handler fails after emitting */
#endif
#ifndef MAXTRIM
#define MAXTRIM 1       /* the effect log is trimmed from the front */
#endif
#ifndef MAXFORGE
#define MAXFORGE 1      /* a forged, replayed or pre-empting message */
#endif
#ifndef MAXSCRASH
#define MAXSCRASH 1     /* the sink runner crashes and resumes */
#endif
/* acquisitions per fence: one, and what the faults can cost */
#ifndef ACQP
#define ACQP (1 + 2*MAXFAULTS)
#endif
#ifndef ACQL
#define ACQL (1 + MAXFAULTS)
#endif
#define MAXACQ (NP*ACQP + ACQL)
#define LOGMAX 18
#define FORGED 31       /* an acquisition token nobody issued */
#define NONE 255

/* ------------------------------------------------------------ faults */
byte faults, nexp, ncrash, nrb, nrec, nloss, nhfail, ntrim, nforge, nscrash;
#define FAULT(c, max) (faults < MAXFAULTS && c < max)
#define TAKE(c) faults++; c++

/* ------------------------------------------------------------ lease bucket */
/* One KV bucket, History 1: a compare-and-set register per key. Its
 * revision is the stream sequence: one counter for every key. Renewals are
 * not modelled (see README): a live record's revision is its epoch. */
typedef Rec {
  unsigned live : 1;
  unsigned rev  : 5;    /* revision of the key's last write (value or marker) */
  unsigned acq  : 5     /* acquisition of a live record */
}
Rec lease[NF];
byte counter;           /* the bucket's last revision */
#if MAXRB > 0
byte lastKey = NONE;    /* the last write, for a rollback that loses it */
Rec lastPrev;
/* tracked only while a rollback can still happen, so that it does not tell
 * otherwise equal states apart */
#define LASTWRITE(x) if :: FAULT(nrb, MAXRB) -> lastKey = x; lastPrev.live = lease[x].live; lastPrev.rev = lease[x].rev; lastPrev.acq = lease[x].acq :: else -> CLEARLAST fi
#define CLEARLAST lastKey = NONE; lastPrev.live = 0; lastPrev.rev = 0; lastPrev.acq = 0
#else
#define LASTWRITE(x) skip
#define CLEARLAST skip
#endif
byte nacq;              /* acquisitions made; acquisition ids are 1..nacq */
byte nacqf[NF];         /* acquisitions per fence */
#define ACQOK(x) (nacqf[x] < ((x) == LOCKF -> ACQL : ACQP))
byte acqEpoch[MAXACQ+1];
byte acqFence[MAXACQ+1];

/* ------------------------------------------------------------ fence records */
/* The companion bucket: per fence {epoch, acquisition, seq, recent epochs}.
 * "fenced" is the history: the acquisitions that fenced the record. */
typedef FRec {
  unsigned e   : 5;
  unsigned a   : 5;
  unsigned seq : 2      /* last job committed (partitions only) */
}
FRec frec[NF];
int fenced[NF];

/* ------------------------------------------------------------ effect log */
#define BARRIER 1
#define EFFECT  2
#define ABORT   3
#define GARBAGE 4       /* a message whose stamp does not parse */
typedef Msg {
  unsigned kind : 3;
  unsigned f    : 2;
  unsigned e    : 5;
  unsigned a    : 5;
  unsigned j    : 2;    /* job sequence; 0: no job headers (a lock's write) */
  unsigned k    : 2;    /* attempt */
  unsigned idx  : 1;    /* effect index within the attempt: the key is (f, j, idx) */
  unsigned fin  : 1;    /* the attempt's final effect */
  unsigned prev : 2     /* the final's previous job in this partition and epoch */
}
Msg log[LOGMAX];        /* position p is log[p-1] */
byte llen;              /* last position stored */
byte lfirst = 1;        /* first position not trimmed */

inline append(K, F, E, A, J, KK, I, FIN, PREV) {
  assert(llen < LOGMAX);
  printf("MSC: log %d: kind %d fence %d epoch %d acq %d job %d attempt %d idx %d final %d prev %d\n", llen + 1, K, F, E, A, J, KK, I, FIN, PREV);
  log[llen].kind = K; log[llen].f = F; log[llen].e = E; log[llen].a = A;
  log[llen].j = J; log[llen].k = KK; log[llen].idx = I; log[llen].fin = FIN;
  log[llen].prev = PREV;
  llen++
}

/* ------------------------------------------------------------ workers */
byte held[3];           /* the acquisition worker w acts under, 0: none */
byte wended;
bit lockDone;
/* With -DLOCKFIRST the lock is taken (in one step) before any partition:
 * a smaller state space, since the lock's epoch no longer shifts every
 * partition epoch after it. */
#ifdef LOCKFIRST
#define LOCKGATE lockDone
#else
#define LOCKGATE 1
#endif
#define HELD(x) ((x) != 0 && (held[0] == (x) || held[1] == (x) || held[2] == (x)))
#define WANT(x) ((x) == LOCKF -> !lockDone : frec[x].seq < NJ)
#define ALLDONE (lockDone && frec[0].seq == NJ && (NP < 2 || frec[NP-1].seq == NJ))

/* ------------------------------------------------------------ sink */
typedef Fence {
  unsigned e      : 5;
  unsigned a      : 5;
  unsigned setter : 2   /* the fence id whose message set it (for I7) */
}
Fence fence[NF];        /* the runner's fences as of pos */
Fence gF[NF];           /* ghost: the highest stamp admitted per fence id (I3) */
Fence savedFence[NF];
byte pos, savedPos;
byte stopped;           /* 1: trimmed gap, 2: an epoch it can no longer verify */
#define GAP 1
#define LAG 2
#ifdef VARIANT_B
#define FSLOT(f) ((f) == LOCKF -> 0 : (f))
#else
#define FSLOT(f) (f)
#endif

/* the attempts (1..3) of a job's group, per (partition, job): bit k-1 of a
 * mask per attempt, two bits per attempt for the effect indexes received
 * and for the previous job its final names; all of one lease */
typedef Slot {
  unsigned e    : 5;
  unsigned a    : 5;
  unsigned on   : 3;    /* attempts open */
  unsigned fin  : 3;    /* attempts whose final came */
  unsigned ab   : 3;    /* attempts whose abort came (a hint) */
  unsigned late : 3;    /* attempts that first came after a higher one */
  unsigned got  : 6;
  unsigned prev : 6
}
Slot slot[NP*NJ];
#define SI(f, j) ((f)*NJ + (j) - 1)
#define KI(f, j, i) (SI(f, j)*2 + (i))
#define BIT(k) (1 << ((k) - 1))
#define ON(s, k) ((slot[s].on >> ((k) - 1)) & 1)
#define FINK(s, k) ((slot[s].fin >> ((k) - 1)) & 1)
#define ABK(s, k) ((slot[s].ab >> ((k) - 1)) & 1)
#define LATEK(s, k) ((slot[s].late >> ((k) - 1)) & 1)
#define GOT(s, k) ((slot[s].got >> (2*((k) - 1))) & 3)
#define PRV(s, k) ((slot[s].prev >> (2*((k) - 1))) & 3)
#define COMPLETE(s, k, j) (ON(s, k) && FINK(s, k) && GOT(s, k) == FULL(j))
#define ANYCOMPLETE(s, j) (COMPLETE(s, 1, j) || COMPLETE(s, 2, j) || COMPLETE(s, 3, j))

#ifndef TODAY_MARKERS
/* The runner's read of a fence record (pE, pA, pSeq) and the log's last
 * position then (pS): taken (ps 1), and applied (ps 2) once the runner has
 * decided the log up to pS. (sink/streamsink/proofs.go) */
byte ps, pS;
byte pE[NP], pA[NP], pSeq[NP];
/* the lease (e, a) of fence f commits no more of job j, by the record read
 * or (rz, in the runner) by a later lease's admitted stamp */
#define SETTLED(f, e, a, j) ((e) < rz || (ps == 2 && ((pE[f] > (e)) || (pE[f] == (e) && pA[f] != (a)) || (pE[f] == (e) && pA[f] == (a) && pSeq[f] >= (j)))))
#define PROOFNOW (pS == llen && pE[0] == frec[0].e && pA[0] == frec[0].a && pSeq[0] == frec[0].seq && \
                  (NP < 2 || (pE[NP-1] == frec[NP-1].e && pA[NP-1] == frec[NP-1].a && pSeq[NP-1] == frec[NP-1].seq)))
#endif

/* the destination: what it applied, with its dedupe records (durable) */
bit appliedKey[NP*NJ*2];
#ifdef VARIANT_G
byte appliedBy[NP*NJ*2]; /* ghost: acquisition<<2 | attempt that applied a key */
#endif
bit jobApplied[NP*NJ];
bit lockKey[32];        /* keys of writes without job headers: one per acquisition */
#ifdef WRITTEN_STATE
bit memApplied[NP*NJ];  /* the runner's own record of applied jobs */
#define PREVAPPLIED(f, j) memApplied[SI(f, j)]
#else
#define PREVAPPLIED(f, j) jobApplied[SI(f, j)]
#endif

/* verdicts */
#define ADMIT 1
#define STALE 2
#define SPLIT 3
#define UNVERIFIED 4
#define UNKNOWN 5

#include "worker.pml"
#include "sink.pml"
#include "env.pml"

#define JOBSAPPLIED (jobApplied[0] && jobApplied[1] && (NP < 2 || (jobApplied[NJ] && jobApplied[NJ+1])))

init {
  atomic {
    byte i = 0;
    do
    :: i < NW -> run Worker(i); i++
    :: else -> break
    od;
#ifdef LOCKFIRST
    run Locker();
#endif
    run Runner();
    run Env();
    run Check()
  }
}

#ifdef LIVENESS
/* Every enqueued job is eventually applied, unless the sink stopped on a
 * gap or an epoch it cannot verify (both visible: an error, a metric and a
 * failed /readyz). Run with pan -a -f (weak fairness). */
ltl progress { <> (stopped != 0 || (wended == NW && JOBSAPPLIED)) }
#endif
