/**
 * A lent session's backend changing hands, and the question after each transaction. Ahead of the
 * session's first messages on a backend it did not use last go the reset (whatever either session's
 * SQL looked like: proxy/isolation/verify.ts HANDOVER) and the session's state made again
 * (proxy/pool/session-state.ts); Postgres's answer decides what follows (a refused reset: the
 * messages go elsewhere; its state refused twice: the session ends). After a transaction that did
 * more than plain reads and writes, the backend is asked what is left, and the session keeps it
 * (proxy/pool/pin.ts) while anything is that cannot move; where the transaction may have changed
 * its LISTEN channels, the client's last ReadyForQuery waits until they are the hub's (proxy/notify/).
 */
import type { Backend } from '../pool/backends'
import type { Ending } from '../pool/idle-watch'
import type { Lender } from '../pool/lender'
import type { SessionPin } from '../pool/pin'
import { statementsOn, type Own } from '../pool/prepared'
import type { SessionState } from '../pool/session-state'
import { NOTHING } from '../isolation/reader'
import { found, handoverReset, HANDOVER_ENDS, quoted, type Carried, type Found } from '../isolation/verify'
import { REPLICA_CLAIMS_ENDS } from '../auth/claims'
import { EMPTY } from '../wire/bytes'
import { TxStatus } from '../wire/codes'
import type { OutcomeKind } from './session'
import type { Lend } from './lend'
import type { Refusals, SessionListening } from '../notify/session-listening'
import { errorResponse } from '../wire/startup'
import { serialize } from 'pg-protocol'

/** What of the session a handover acts through. */
export interface HandoverHost {
  readonly lend?: Lend
  /** Its transaction ended cleanly and it keeps its backend until another session needs it. */
  readonly parked: boolean
  /** Answers of the proxy's own still due on the lend. */
  verifying: number
  /** Messages wait for a backend. */
  readonly waiting: readonly Buffer[]
  /** The session's key's lender on the primary. */
  readonly lender: Lender
  send(msgs: Buffer[], owned?: boolean): void
  unqueue(): Buffer[]
  detach(lend: Lend): void
  ending(lend: Lend, reusable?: boolean): Ending | undefined
  next(): void
  /** What the session sent on a lend that ran none of it, to another backend (the lend's is closed). */
  elsewhere(lend: Lend, sent: Buffer[]): void
  evict(kind: OutcomeKind, code: string, message: string): void
  /** A transaction that left nothing: the backend stays with the session while no other needs it, else goes back. */
  lendOn(lend: Lend): void
  /** A standby refused the session's claims or settings: its reads stay on the primary. */
  refusedOnReplica(): void
  /** Its LISTEN channels, through the key's hub (proxy/notify/session-listening.ts). */
  readonly listening?: SessionListening
  /** What Postgres sent from a transaction's end on, held until its channels were registered, to the client now (behind `first`, if any). */
  release(lend: Lend, first?: Buffer): void
}

/** What a backend given to the session lacks: the reset (it changed hands) and the session's state (the session did not use it last). */
export interface Change {
  reset: boolean
  carried?: Carried
}

export class LentHandover {
  /** Who the session is to a backend's Backend.user (not the session itself: a backend outlives it). */
  private readonly user = {}
  /** Leads carrying the session's state refused in a row. */
  private carryRefused = 0

  constructor(private readonly host: HandoverHost, private readonly pin: SessionPin, private readonly state: SessionState, private readonly statementsPerBackend: number) {}

  /** `backend` is the session's now: what it lacks. */
  take(backend: Backend, onReplica: boolean): Change {
    const reset = backend.user !== undefined && backend.user !== this.user
    if (reset) backend.resets++ // (DISCARD ALL drops its prepared statements)
    // (A backend the session did not use last lacks its settings: a reset one too.)
    const carried = backend.user !== this.user ? this.state.carried(onReplica) : undefined
    backend.user = this.user
    return { reset, carried }
  }

  /** Ahead of the session's messages, in their group: the reset, the session's state, and on a standby a token's claims (each lend: the session may have reset them). */
  lead(lend: Lend, { reset, carried }: Change, claims: Buffer | undefined) {
    if (!reset && !carried && !claims) return
    lend.handover = { sent: [], bytes: 0, synced: false }
    const resetBytes = reset ? handoverReset() : undefined
    const ends = (reset ? HANDOVER_ENDS : 0) + (carried?.ends ?? 0) + (claims ? REPLICA_CLAIMS_ENDS : 0)
    const lead = carried || claims ? Buffer.concat([resetBytes ?? EMPTY, carried?.bytes ?? EMPTY, claims ?? EMPTY]) : resetBytes!
    lend.relay.lead(lead, ends, (ok) => this.answered(lend, ok, reset, !!claims, !!carried))
  }

  /**
   * Postgres answered the lead: what waited behind it goes; or it refused it (and skipped what came
   * behind, up to a Sync), and the backend, which no reset cleans, is closed and the session's
   * messages go to another, unseen.
   */
  private answered(lend: Lend, ok: boolean, reset: boolean, claims: boolean, carried: boolean) {
    const host = this.host
    const sent = lend.handover!.sent
    lend.handover = undefined
    if (reset) host.lender.events.handedOver(ok ? 'reset' : 'refused')
    if (host.lend !== lend) return
    // (A standby that refused the session's claims or settings: it reads where they are set, on the primary.)
    if (!ok && (claims || (carried && lend.onReplica))) host.refusedOnReplica()
    this.carryRefused = ok || !carried || lend.onReplica ? 0 : this.carryRefused + 1
    if (this.carryRefused > 1) {
      // (Refused twice running, on two backends: Postgres will not take the session's state any more, a privilege revoked say.)
      const names = this.state.carried()?.names.join(', ')
      return host.evict('upstream_error', '55000', `edgepg-proxy: the session's settings and prepared statements (${names}) could not be made again on another backend, as transaction pooling does for each transaction: the session is closed`)
    }
    if (!ok) return host.elsewhere(lend, sent)
    if (host.waiting.length && lend.onReplica?.gatedSince === undefined) host.send(host.unqueue(), true) // (a replica's, once caught up)
  }

  /**
   * A transaction is over: the backend stays with the session while no other needs it, and goes on
   * (to be reset by its next taker) unless the session keeps it for state it made: a transaction that
   * did more than plain reads and writes, by the parser or by Postgres's command tags, is followed by
   * the backend's own account of what is left. (A replica's read is plain: what code left there is
   * the next taker's reset's.) A backend the session keeps anyway is not asked.
   */
  ended(lend: Lend) {
    const { host, pin } = this
    if (host.parked || host.verifying) return
    const e = lend.effects
    const heldOut = !!lend.relay.heldOut // (the channels may have changed: the question comes first)
    const plain = (e.plain && !lend.relay.unusual) || !!lend.onReplica
    lend.effects = NOTHING
    lend.relay.unusual = false
    if (e.unseen && lend.onReplica) {
      // (No session keeps a standby's backend: one left with what no reset takes is closed, and the session reads on.)
      host.detach(lend)
      lend.lender.endSession(lend.backend, host.ending(lend, false))
      return host.next()
    }
    if (e.unseen) (pin.forGood = true), pin.pin('unseen')
    if (!heldOut && (pin.forGood || (pin.reason && plain))) return pin.mayLeave(false)
    if (plain && !heldOut) return host.lendOn(lend)
    lend.relay.ownQuery(this.question(lend))
    host.verifying++
    host.lender.events.verified()
    pin.mayLeave(true) // (if pinned: until the answer)
  }

  /**
   * Asks the backend what the transaction left, in messages of the proxy's own behind the client's
   * answer (no round trip of its own; but where the relay holds that answer back, its channels are
   * registered with the hub first, then it goes). The session keeps the backend meanwhile; the
   * transaction is then decided on the answer (or, if the session has begun another, with it).
   */
  private question(lend: Lend): Own {
    const { host, pin } = this
    const rows: string[] = []
    const ready = (status: number) => {
      // (Asked inside a transaction, the answer says nothing of what the transaction will leave.)
      const f = status === TxStatus.Idle ? found(rows) : undefined
      if (!lend.relay.heldOut || !host.listening) return this.decide(lend, f, false)
      // The transaction's end waits for its channels: registered, the client hears of it.
      host.listening
        .update(f?.channels ?? [...host.listening.channels])
        .then((refusals) => {
          this.state.listenOn([...host.listening!.channels])
          if (!refusals.length || host.lend !== lend) return host.release(lend), this.decide(lend, f, true)
          // (Refused ones are the session's no more, on its backend either.)
          const unlisten = serialize.query(refusals.map((r) => `UNLISTEN ${quoted(r.channel)}`).join('; '))
          lend.relay.ownQuery({ query: unlisten, ready: () => (host.release(lend, refused(refusals)), this.decide(lend, f, true)) })
        })
        .catch((err: Error) => host.evict('upstream_error', 'XX000', `edgepg-proxy: the session's LISTEN channels could not be registered: ${err.message}`))
    }
    return { query: host.lender.verification, onRow: (value) => rows.push(value), ready }
  }

  /** The question's answer is in: the backend stays with the session for what is left, or goes on (`heard`: its channels are the hub's). */
  private decide(lend: Lend, f: Found | undefined, heard: boolean) {
    const { host, pin } = this
    if (host.lend !== lend) return pin.mayLeave(false) // (its backend went, and the count of answers due with it)
    host.verifying--
    const stays = f && this.state.learn(f)
    const statements = statementsOn(lend.backend, this.statementsPerBackend).held.size
    const left = f ? (f.left.find((l) => l !== 'listen' || !heard) ?? stays ?? (f.statements > statements ? 'statements' : undefined)) : 'unverified'
    if (left) pin.pin(left)
    else pin.unpin(), this.afterOwn(lend)
    pin.mayLeave(host.lend === lend && lend.watch.pending > 0)
  }

  /** An answer of the proxy's own is in: the transaction, if it is over, is decided now. */
  afterOwn(lend: Lend) {
    const host = this.host
    if (!host.verifying && lend.watch.settled === TxStatus.Idle && (!host.waiting.length || lend.onReplica)) this.ended(lend)
  }
}

/** Channels not listened on, as Postgres says no: one error ahead of the transaction's end. */
function refused(refusals: Refusals): Buffer {
  const { code } = refusals[0]
  return errorResponse(code, refusals.map((r) => r.message).join('; '), 'ERROR')
}
