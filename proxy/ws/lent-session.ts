/**
 * A session in transaction pooling: it holds a backend only while it runs something, from its
 * first message after ReadyForQuery(I) to the next ReadyForQuery(I), and none in between.
 *
 * When a transaction ends the session gives its backend back, unless the transaction may have left
 * state behind (proxy/pool/state.ts reads every statement it ran; the database is asked once
 * whether it runs code of its own): then the session keeps that backend to its end ("pinned"), so
 * that it keeps its state and no other session sees it. Named prepared statements follow it from
 * backend to backend (proxy/pool/prepared.ts). currval() and lastval() hold only within the
 * transaction that called nextval(): no other session runs on the backend before DISCARD SEQUENCES.
 */
import type { WebSocket, RawData } from 'ws'
import { serialize } from 'pg-protocol'
import type { Backend } from '../pool/backends'
import { RUNS_CODE, type Lender } from '../pool/lender'
import { IdleWatch } from '../pool/idle-watch'
import { BackendStatements, StatementRelay, type SessionStatements } from '../pool/prepared'
import { effects, leftBehind, merge, NOTHING, type StatementEffects } from '../pool/state'
import { Framer, kept, MessageTooLarge } from '../wire/bytes'
import { ClientMessage, ServerMessage, TxStatus } from '../wire/codes'
import { cString, errorResponse, type BackendKey } from '../wire/startup'
import type { BufferBudget, SessionMemory } from './budget'
import { cancelNamed } from './cancels'
import { setClaims, type ClaimsError } from '../auth/claims'
import { closeWebSocket, type OutcomeKind, type RunningSession, type SessionLog } from './session'

export interface LentSessionOptions {
  lender: Lender
  /** The login's answer, sent first. */
  answer: Buffer
  loginBytes: number
  peer: string
  upstream: string
  budget?: BufferBudget
  log?: (entry: SessionLog) => void
  onActivity?: () => void
  /** The statement running now, for a cancel: known by the key the session was told until the returned function is called. */
  follow(running: () => BackendKey | undefined): () => void
  /** Statements each backend keeps for the sessions it serves (--pool-statements). */
  statementsPerBackend: number
  /** A login by token: its claims, set on each backend lent to the session before anything of its runs there (proxy/auth/claims.ts). */
  claims?: string
}

/** What a session pinned to its backend holds that no other may see. */
export type PinReason = 'state' | 'code'

interface Lend {
  backend: Backend
  relay: StatementRelay
  watch: IdleWatch
  /** What the transaction's statements may have left behind. */
  effects: StatementEffects
}

const HIGH_WATER = 1 << 20
/** What a message waiting for a backend costs beside its bytes (its Buffer: ~110 bytes of heap, measured). */
const QUEUED_COST = 128
const DISCARD_SEQUENCES = serialize.query('DISCARD SEQUENCES')
/** The statements each backend holds, by backend. */
const held = new WeakMap<Backend, BackendStatements>()

export function runLentSession(ws: WebSocket, o: LentSessionOptions): RunningSession {
  return new LentSession(ws, o)
}

class LentSession implements RunningSession {
  private readonly started = Date.now()
  private bytesIn: number
  private bytesOut = 0
  private outcome = 'closed by client'
  private kind: OutcomeKind = 'ok'
  private lend?: Lend
  /** Client messages waiting for a backend, and what they cost (counted with the budget). */
  private waiting: Buffer[] = []
  private queued = 0
  private acquiring = false
  pinned?: PinReason
  /** Its transaction ended cleanly and it keeps its backend until another session needs it. */
  private parked = false
  /** Asking the database, on its backend, whether it runs code of its own. */
  private learning = false
  private readonly statements: SessionStatements = new Map()
  private readonly framer: Framer
  /** The most it may hold of the client's: one protocol message under way, and what waits for a backend (--max-message-bytes). */
  private readonly maxHeld: number
  private readonly memory?: SessionMemory
  /** The unnamed statement's effects, as last parsed. */
  private unnamed: StatementEffects = NOTHING
  private ended = false
  /** While it waits in line for a backend: how to leave it (when the session ends). */
  private leaveLine?: (reason: Error) => void
  /** ReadyForQuery messages the client has been sent since its login (Postgres's and the proxy's own): names its statements to a cancel. */
  private readies = 0
  /** The statement a cancel was sent for (by readies), so that it is sent once. */
  private cancelled = -1
  private readonly unfollow: () => void

  constructor(private readonly ws: WebSocket, private readonly o: LentSessionOptions) {
    this.bytesIn = o.loginBytes
    this.maxHeld = o.budget?.maxMessageBytes ?? Infinity
    this.framer = new Framer(this.maxHeld)
    this.memory = o.budget?.watch(ws, () => {
      this.end('over_budget', 'closed: over the memory budget (--max-client-buffer)')
      this.finish() // (what it held goes with it)
    })
    this.memory?.loggedIn()
    // (A lend not parked may be running something: a portal's Execute awaits no Sync. Postgres ignores a cancel while idle.)
    this.unfollow = o.follow(() => (this.lend && !this.parked ? this.lend.backend.key : undefined))
    this.toClient(o.answer)
    ws.on('message', this.onClientMessage)
    ws.on('close', () => {
      this.finish()
      const { peer, upstream, log } = this.o
      log?.({ peer, upstream, durationMs: Date.now() - this.started, bytesIn: this.bytesIn, bytesOut: this.bytesOut, outcome: this.outcome, kind: this.kind, authFailed: false })
    })
    ws.on('error', (err) => this.end('client_error', `client error: ${err.message}`))
  }

  close(kind: 'timeout' | 'shutdown' | 'token_expired', code: number, reason: string, last?: Buffer) {
    this.end(kind, reason.replace(/^edgepg-proxy: /, ''))
    if (last) this.toClient(last)
    closeWebSocket(this.ws, code, reason)
  }

  private end(kind: OutcomeKind, outcome: string) {
    this.kind = kind
    this.outcome = outcome
  }

  // ── client → Postgres ───────────────────────────────────────────────────────────────────────

  private readonly onClientMessage = (data: RawData, isBinary: boolean) => {
    if (this.ended) return
    if (!isBinary) {
      if (this.cancelFrame(data as Buffer)) return
      this.end('client_error', 'refused a text frame')
      return closeWebSocket(this.ws, 1003, 'edgepg-proxy: expected binary frames')
    }
    const chunk = data as Buffer
    this.bytesIn += chunk.length
    this.o.onActivity?.()
    let msgs: Buffer[]
    try {
      msgs = this.framer.push(chunk)
    } catch (err) {
      this.end('client_error', `client error: ${(err as Error).message}`)
      if (err instanceof MessageTooLarge) return this.holdsTooMuch(`a protocol message of ${err.length} bytes`)
      return closeWebSocket(this.ws, 1002, 'edgepg-proxy: not protocol messages')
    }
    const terminate = msgs.findIndex((m) => m[0] === ClientMessage.Terminate)
    if (terminate >= 0) msgs = msgs.slice(0, terminate)
    if (msgs.length) {
      if (this.lend && this.parked) this.o.lender.unpark(this.lend.backend), (this.parked = false)
      if (this.lend) this.send(msgs)
      else {
        for (const m of msgs) this.waiting.push(kept(m)), (this.queued += m.length + QUEUED_COST)
        if (!this.acquiring) this.acquire()
      }
    }
    if (!this.holds()) return
    if (terminate >= 0) {
      this.finish()
      closeWebSocket(this.ws, 1000)
    }
  }

  /**
   * What it holds of the client's (a message under way, messages waiting for a backend) is within
   * --max-message-bytes and counted in the budget: false once it is closed for it.
   */
  private holds(): boolean {
    const bytes = this.framer.holding + this.queued
    if (bytes > this.maxHeld) {
      this.end('client_error', `client error: held ${bytes} bytes of its messages, over the limit of ${this.maxHeld}`)
      return this.holdsTooMuch(this.queued ? 'messages waiting for a backend' : 'a protocol message'), false
    }
    return this.memory?.hold(bytes) ?? true
  }

  /** Closed as ws closes a WebSocket message over the limit. */
  private holdsTooMuch(what: string) {
    this.finish()
    closeWebSocket(this.ws, 1009, `edgepg-proxy: ${what} over --max-message-bytes (${this.maxHeld})`)
  }

  /** What waits for a backend, taken out of the queue. */
  private unqueue(): Buffer[] {
    const msgs = this.waiting
    this.waiting = []
    this.queued = 0
    this.memory?.hold(this.framer.holding)
    return msgs
  }

  /**
   * `cancel <n>` (SUBPROTOCOL_CANCEL): the client has read n ReadyForQuery and wants the statement
   * after them stopped, wherever it runs now. Acted on only while that statement is the one
   * running, once (as in proxy/ws/session.ts).
   */
  private cancelFrame(data: Buffer): boolean {
    const readies = cancelNamed(this.ws, data)
    if (readies === undefined) return false
    const lend = this.lend
    if (lend && !this.parked && readies === this.readies && this.cancelled !== readies) {
      this.cancelled = this.readies
      lend.backend.upstream.cancel(lend.backend.key)
    }
    return true
  }

  private send(msgs: Buffer[]) {
    const lend = this.lend!
    for (const m of msgs) lend.effects = merge(lend.effects, this.effectsOf(m))
    const bytes = Buffer.concat(msgs)
    lend.watch.fromClient(bytes)
    lend.relay.forward(msgs) // (framed once, above)
  }

  /** What running `msg` may leave behind. */
  private effectsOf(msg: Buffer): StatementEffects {
    if (msg[0] === ClientMessage.Query) return effects(cString(msg.subarray(5)))
    if (msg[0] === ClientMessage.Parse) {
      const name = cString(msg.subarray(5))
      const e = effects(cString(msg.subarray(6 + Buffer.byteLength(name))))
      if (!name) this.unnamed = e
      return e
    }
    if (msg[0] === ClientMessage.Bind) {
      const name = cString(msg.subarray(msg.indexOf(0, 5) + 1))
      const parse = name ? this.statements.get(name) : undefined
      return name ? (parse ? effects(cString(parse.subarray(6 + Buffer.byteLength(name)))) : NOTHING) : this.unnamed
    }
    return NOTHING
  }

  private acquire() {
    this.acquiring = true
    this.o.lender.acquire((leave) => (this.leaveLine = leave)).then(
      (backend) => {
        this.leaveLine = undefined
        const { claims } = this.o
        if (claims === undefined || this.ended) return this.begin(backend)
        // A login by token: its claims on the backend first (proxy/auth/claims.ts).
        setClaims(backend.upstream, claims).then(
          () => this.begin(backend),
          (err: ClaimsError) => {
            this.o.lender.lost(backend) // (closed: it serves no one)
            this.refuseWaiting(err)
          }
        )
      },
      (err: Error & { code?: string }) => {
        this.leaveLine = undefined
        this.refuseWaiting(err, `edgepg-proxy: ${err.message}`)
      }
    )
  }

  /** The backend is the session's now: what waited for it goes (unless the session ended meanwhile). */
  private begin(backend: Backend) {
    this.acquiring = false
    if (this.ended) return this.o.lender.giveBack(backend)
    this.startLend(backend)
    this.send(this.unqueue())
  }

  /** No backend for what waits: each Query and Sync gets Postgres's way of saying no, an error and ReadyForQuery. */
  private refuseWaiting(err: Error & { code?: string }, message = err.message) {
    this.acquiring = false
    if (this.ended) return
    const answers = this.unqueue().filter((m) => m[0] === ClientMessage.Query || m[0] === ClientMessage.Sync).length
    for (let i = 0; i < answers; i++) this.toClient(Buffer.concat([errorResponse(err.code ?? '08006', message, 'ERROR'), READY_IDLE]))
    this.readies += answers
  }

  private startLend(backend: Backend) {
    let statements = held.get(backend)
    if (!statements) held.set(backend, (statements = new BackendStatements(this.o.statementsPerBackend)))
    const { events } = this.o.lender
    const relay = new StatementRelay(this.statements, statements, (bytes) => void (backend.upstream.write(bytes) || this.ws.pause()), events.preparedAgain)
    this.lend = { backend, relay, watch: new IdleWatch(), effects: NOTHING }
    backend.upstream.onDrain = () => this.ws.resume()
    backend.upstream.on('close', this.onBackendClose)
    const early = backend.upstream.relay(this.fromBackend)
    // Another session's nextval() left currval() behind: gone before this session's first message (no round trip of its own).
    if (this.o.lender.takeSequences(backend)) relay.ownQuery(DISCARD_SEQUENCES)
    backend.upstream.resume()
    if (early.length) this.fromBackend(early)
  }

  // ── Postgres → client ───────────────────────────────────────────────────────────────────────

  private readonly fromBackend = (chunk: Buffer) => {
    const lend = this.lend
    if (!lend) return
    const visible = lend.relay.fromBackend(chunk)
    const readies = lend.watch.readies
    lend.watch.fromBackend(visible)
    this.readies += lend.watch.readies - readies
    if (visible.length) this.toClient(visible)
    // A parked backend speaks only to say it is going away (a FATAL): it stays with this session
    // (which ends as it closes), and no other may take it meanwhile.
    if (this.parked && lend.watch.last === ServerMessage.ErrorResponse) return this.o.lender.unpark(lend.backend), void (this.parked = false)
    const ending = lend.watch.ending
    if (this.lend === lend && ending && ending.pending === 0 && ending.status === TxStatus.Idle && !this.waiting.length) this.transactionEnded(lend)
  }

  private readonly resumeBackend = () => this.lend?.backend.upstream.resume()
  private toClient(chunk: Buffer) {
    this.o.onActivity?.()
    this.bytesOut += chunk.length
    const congested = this.ws.bufferedAmount + chunk.length > HIGH_WATER
    this.ws.send(chunk, congested ? this.resumeBackend : undefined)
    if (congested) this.lend?.backend.upstream.pause()
  }

  /** A transaction is over: the backend goes back, unless it may hold what the session set. */
  private transactionEnded(lend: Lend) {
    if (this.parked || this.learning) return
    const e = lend.effects
    lend.effects = NOTHING
    if (e.ddl) this.o.lender.stale()
    if (this.pinned) return
    const reason = leftBehind(e, this.o.lender.runsCode)
    if (reason === 'unknown') return this.learn(lend, e)
    if (reason) {
      this.pinned = reason
      this.o.lender.events.pinned(reason)
      return
    }
    // Left with this session while no other needs it (another session will not see its currval: see startLend).
    if (this.o.lender.park(lend.backend, this.surrender)) {
      if (e.sequences) this.o.lender.usedSequences(lend.backend)
      return void (this.parked = true)
    }
    this.detach(lend)
    this.o.lender.giveBack(lend.backend, e)
  }

  /**
   * Whether the database runs code of its own is not known (DDL ran since it was asked): asked on
   * this backend, which the session keeps meanwhile; the transaction is then decided on the answer
   * (or, if the session has begun another, with it).
   */
  private learn(lend: Lend, e: StatementEffects) {
    if (this.learning) return void (lend.effects = merge(lend.effects, e))
    this.learning = true
    lend.relay.ownQuery(RUNS_CODE, (value) => this.o.lender.learned(value), () => {
      this.learning = false
      if (this.lend !== lend) return
      const ending = lend.watch.ending
      if (ending && ending.pending === 0 && ending.status === TxStatus.Idle && !this.waiting.length) {
        lend.effects = merge(lend.effects, e)
        this.transactionEnded(lend)
      } else lend.effects = merge(lend.effects, e)
    })
  }

  /** Another session takes the parked backend: from now on this one acquires anew. */
  private readonly surrender = () => {
    this.parked = false
    if (this.lend) this.detach(this.lend)
  }

  private detach(lend: Lend) {
    lend.backend.upstream.onDrain = undefined
    lend.backend.upstream.off('close', this.onBackendClose)
    this.lend = undefined
  }

  /**
   * Postgres went away under a lend (parked ones included: the session ran its last transaction
   * there). If it said why (a FATAL: the backend was terminated, or the server is shutting down),
   * the session ends after that word, as a TCP connection to it would:
   * what pg, and code written for it, expect. If it left without a word (the network, a crash),
   * what ran there fails with a clear error and the session goes on, on another backend, unless it
   * had state on that one.
   */
  private readonly onBackendClose = () => {
    const lend = this.lend
    if (!lend) return
    this.detach(lend)
    this.o.lender.lost(lend.backend)
    this.parked = false
    if (lend.watch.last === ServerMessage.ErrorResponse) {
      this.end('ok', 'closed by upstream')
      return closeWebSocket(this.ws, 1000)
    }
    if (this.pinned) {
      this.end('upstream_error', 'upstream error: a pinned backend was lost')
      return closeWebSocket(this.ws, 1011, 'edgepg-proxy: the connection to Postgres was lost, and the session state on it')
    }
    const lost = errorResponse('08006', 'edgepg-proxy: the connection to Postgres was lost while this ran; nothing of its transaction was kept', 'ERROR')
    for (let i = 0; i < lend.watch.pending; i++) this.toClient(Buffer.concat([lost, READY_IDLE]))
    this.readies += lend.watch.pending
  }

  /** The session is over: its backend, if it holds one, goes back (reset, or closed if busy). */
  private finish() {
    if (this.ended) return
    this.ended = true
    this.waiting = []
    this.leaveLine?.(new Error('the session ended'))
    this.unfollow()
    const lend = this.lend
    if (!lend) return
    this.detach(lend)
    if (this.parked) return this.o.lender.giveBack(lend.backend)
    // (The reset waits out what Postgres still owes: the session's answers, and the proxy's own.)
    const ending = lend.watch.ending
    this.o.lender.endSession(lend.backend, ending && { ...ending, pending: ending.pending + lend.relay.ownReadiesDue })
  }
}

const READY_IDLE = Buffer.from([ServerMessage.ReadyForQuery, 0, 0, 0, 5, TxStatus.Idle])
