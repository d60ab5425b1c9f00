/**
 * A session in transaction pooling: it holds a backend only while it runs something, from its
 * first message after ReadyForQuery(I) to the next ReadyForQuery(I), and none in between.
 *
 * A backend that changes hands is reset (DISCARD ALL) at the head of its next session's first write,
 * whatever either session's SQL looked like (proxy/isolation/verify.ts HANDOVER), and the session's
 * state is made again behind it; one that goes back to the session that used it last is not. A
 * transaction that did more than plain reads and writes (by Postgres's parser and its command tags,
 * proxy/isolation/reader.ts) is followed by the backend's own account of what is left, and where
 * anything is that cannot move, the session keeps that backend (pinned: proxy/pool/pin.ts) until a
 * later account finds it clean. Its settings, role and SQL prepared statements (by Postgres's
 * reports and account: proxy/pool/session-state.ts) and its protocol-level named statements
 * (proxy/pool/prepared.ts) follow it from backend to backend; its reads may go to replicas
 * (proxy/replicas/session-reads.ts).
 */
import type { WebSocket, RawData } from 'ws'
import type { Backend } from '../pool/backends'
import { LoginRefused, PoolTimeout, type Lender } from '../pool/lender'
import type { Holder } from '../pool/holders'
import { IdleWatch, type Ending } from '../pool/idle-watch'
import { statementsOn, StatementRelay, type Own, type SessionStatements } from '../pool/prepared'
import { merge, NOTHING, type Reading } from '../isolation/reader'
import { SessionReading } from '../isolation/session-reading'
import type { Signals } from './signals'
import { found, handoverReset, HANDOVER_ENDS } from '../isolation/verify'
import { loginReports, SessionState } from '../pool/session-state'
import { EMPTY, Framer, kept, MessageTooLarge } from '../wire/bytes'
import { ClientMessage, ServerMessage, TxStatus } from '../wire/codes'
import { errorResponse, type BackendKey } from '../wire/startup'
import type { BufferBudget, SessionMemory } from './budget'
import { cancelNamed } from './cancels'
import { DueSignals } from './due-signals'
import { REPLICA_CLAIMS_ENDS, replicaClaimsMessages, setClaims, type ClaimsError } from '../auth/claims'
import { closeWebSocket, type OutcomeKind, type RunningSession, type SessionLog } from './session'
import { downForAll, recheckIn, type Fallback, type Replica } from '../replicas/replicas'
import { HOLD_MAX, POSITIONS_MAX, refusedAsWrite, routeOf, SessionSeen, type OnReplica, type SessionReplicas } from '../replicas/session-reads'
import { SessionPin } from '../pool/pin'
import { POSITION_MESSAGE, SUBPROTOCOL_POSITIONS } from '../../src/config'

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
  /** Who the session is for the per-client share of backends: a token's subject, else the client's address. */
  client?: string
  /** End a session idle inside a transaction this long (ms; 0: never), as Postgres's idle_in_transaction_session_timeout would. */
  idleInTransactionMs?: number
  /** The processID the session was told (none a backend has), and where sessions are found by it. */
  pid: number
  signals: Signals
  /** Reads to the upstream's hot standbys (proxy/replicas/), for a session whose login they can serve. */
  replicas?: SessionReplicas
}

interface Lend {
  backend: Backend
  /** The backend changed hands, and its reset is not answered yet: what the session sent behind it (sent elsewhere if Postgres refuses the reset), and whether a Sync went (nothing more goes until the answer). */
  handover?: { sent: Buffer[]; bytes: number; synced: boolean }
  /** Whose backend it is: the session's key's on the primary, or on a replica. */
  lender: Lender
  onReplica?: OnReplica
  /** ReadyForQuery messages of the lend's the client has been sent. */
  delivered: number
  /** The primary's position is being asked behind the session's messages: their last ReadyForQuery waits for it here. */
  positionDue: number
  /** A COPY FROM STDIN ends the transaction: the position is asked once Postgres has answered all (see send). */
  positionAfter?: boolean
  tail?: Buffer
  relay: StatementRelay
  watch: IdleWatch
  /** What the transaction's statements may have left behind, as the parser reads them. */
  effects: Reading
}

const HIGH_WATER = 1 << 20
/** `f` once the code running now is done: a microtask (a resolved promise's, cheaper than queueMicrotask's). */
const RESOLVED = Promise.resolve()
const soon = (f: () => void) => void RESOLVED.then(f)
/** What a message waiting for a backend costs beside its bytes (its Buffer: ~110 bytes of heap, measured). */
const QUEUED_COST = 128

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
  /** It keeps its backend for what its verification found left (proxy/pool/pin.ts). */
  private readonly pin: SessionPin
  /** Its transaction ended cleanly and it keeps its backend until another session needs it. */
  private parked = false
  /** Verifications under way: asking its backend what its transactions left (proxy/isolation/verify.ts). */
  private verifying = 0
  private readonly statements: SessionStatements = new Map()
  /** What its messages may leave behind, as the parser reads them. */
  private readonly reading: SessionReading
  private readonly framer: Framer
  /** The most it may hold of the client's: one protocol message under way, and what waits for a backend (--max-message-bytes). */
  private readonly maxHeld: number
  private readonly memory?: SessionMemory
  private ended = false
  /** While it waits in line for a backend: how to leave it (when the session ends). */
  private leaveLine?: (reason: Error) => void
  /** ReadyForQuery messages the client has been sent since its login (Postgres's and the proxy's own): names its statements to a cancel. */
  private readies = 0
  /** The statement a cancel was sent for (by readies), so that it is sent once. */
  private cancelled = -1
  private readonly unfollow: () => void
  private readonly unsignal: () => void
  private idleInTransaction?: NodeJS.Timeout
  /** Signals for sessions (pg_terminate_backend…) its statements ask for (proxy/ws/due-signals.ts). */
  private readonly signalsDue: DueSignals
  /** Nothing runs and the client sends nothing, inside a transaction. */
  private idleInTx = false
  /** Who the session is to the per-client share of backends. */
  private readonly holder?: Holder
  /** How far it has seen: its reads must not go behind that. */
  private readonly seen: SessionSeen
  /** What waits goes to the primary: a replica could not serve it. */
  private toPrimary = false
  /** A replica could not run the session's check (its login's settings forbid it there: serializable by default): its reads stay on the primary. */
  private replicaRefused = false
  /** A read waits for a replica to replay what the session has seen, with no backend meanwhile: since when, and how often it asked. */
  private replayWait?: { since: number; tries: number }
  private replayTimer?: NodeJS.Timeout
  /** Who it is to a backend's Backend.user (not the session itself: a backend outlives it). */
  private readonly user = {}
  /** What follows the session from backend to backend: its settings and SQL prepared statements. */
  private readonly state: SessionState
  /** Leads carrying the session's state refused in a row. */
  private carryRefused = 0

  constructor(private readonly ws: WebSocket, private readonly o: LentSessionOptions) {
    this.bytesIn = o.loginBytes
    if (o.client !== undefined) this.holder = { client: o.client, idleInTransaction: () => this.idleInTx, evict: (message) => this.evict('over_share', '25P03', message) }
    this.maxHeld = o.budget?.maxMessageBytes ?? Infinity
    this.framer = new Framer(this.maxHeld)
    this.memory = o.budget?.watch(ws, () => {
      this.end('over_budget', 'closed: over the memory budget (--max-client-buffer)')
      this.finish() // (what it held goes with it)
    })
    this.memory?.loggedIn()
    this.pin = new SessionPin(o.lender, (message) => this.evict('over_share', '53400', message))
    this.seen = new SessionSeen(ws, o.replicas?.set)
    this.signalsDue = new DueSignals(o.signals, o.lender.role)
    this.unsignal = o.signals.attach(o.pid, {
      role: o.lender.role,
      // Its statement running now, if any (as a CancelRequest for its processID would).
      cancel: () => this.lend && !this.parked && this.lend.watch.pending > 0 && this.lend.backend.upstream.cancel(this.lend.backend.key),
      terminate: () => this.evict('ok', '57P01', 'terminating connection due to administrator command'),
    })
    // (A lend not parked may be running something: a portal's Execute awaits no Sync. Postgres ignores a cancel while idle.)
    this.unfollow = o.follow(() => (this.lend && !this.parked ? this.lend.backend.key : undefined))
    this.state = new SessionState(loginReports(o.answer))
    this.reading = new SessionReading(o.lender.read, this.statements)
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
      if (this.cancelFrame(data as Buffer) || this.seen.afterFrame(data as Buffer)) return
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
    if (this.ws.protocol === SUBPROTOCOL_POSITIONS && msgs.some((m) => m[0] === POSITION_MESSAGE)) {
      const rest = this.seen.takePositions(msgs)
      if (!rest) {
        this.end('client_error', `refused a position message over ${POSITIONS_MAX} bytes`)
        return closeWebSocket(this.ws, 1002, 'edgepg-proxy: position message too long')
      }
      msgs = rest
    }
    const terminate = msgs.findIndex((m) => m[0] === ClientMessage.Terminate)
    if (terminate >= 0) msgs = msgs.slice(0, terminate)
    if (msgs.length) {
      clearTimeout(this.idleInTransaction)
      this.idleInTx = false
      if (this.lend && this.parked) {
        // (Parked where the next transaction should not run: given back, and it is lent anew.)
        if (this.o.replicas && this.route(msgs) !== 'primary') this.surrenderParked()
        else this.lend.lender.unpark(this.lend.backend), (this.parked = false)
      }
      if (this.lend && !this.waitsOnReplica(this.lend)) this.send(msgs)
      else {
        this.queue(msgs)
        if (!this.lend && !this.acquiring) this.acquire()
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

  /**
   * A ParameterStatus goes to the client only where it changes what the client was told: a reset
   * on a backend that changed hands reports the previous session's settings going back to the login's.
   */
  private readonly parameter = (msg: Buffer): boolean => {
    const nameEnd = msg.indexOf(0, 5)
    return this.state.report(msg.toString('utf8', 5, nameEnd), msg.toString('utf8', nameEnd + 1, msg.length - 1))
  }

  private queue(msgs: Buffer[]) {
    let bytes = 0
    for (const m of msgs) bytes += m.length
    // (Views that are most of the one buffer they share, a WebSocket message's, are kept as they are: kept() of each would copy them all.)
    const most = msgs.length > 0 && msgs.every((m) => m.buffer === msgs[0].buffer) && bytes * 2 >= msgs[0].buffer.byteLength
    for (const m of msgs) this.waiting.push(most ? m : kept(m)), (this.queued += m.length + QUEUED_COST)
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

  /**
   * A replica's lend takes no new messages while it waits to catch up, nor once its transaction is
   * over (its verification may still be under way): they are routed afresh, when it is given back.
   */
  private waitsOnReplica(lend: Lend): boolean {
    return !!lend.onReplica && (lend.onReplica.gatedSince !== undefined || lend.watch.settled === TxStatus.Idle)
  }

  /**
   * Where messages that start a transaction go (proxy/replicas/session-reads.ts), for a session whose
   * reads may go to replicas: the primary once a replica could not serve it, while it is pinned, and
   * for a session by token until the replica key for its claims is learnt (see acquireOn).
   */
  private route(msgs: Buffer[]): 'primary' | 'replica' | 'autocommit' {
    const replicas = this.o.replicas
    if (!replicas || this.toPrimary || this.replicaRefused || this.pin.reason || (this.o.claims !== undefined && !replicas.claimsKey.key)) return 'primary'
    return routeOf(msgs, this.o.lender.read, replicas.readOnly, replicas.set.o.autocommit)
  }

  /** The primary's position, asked behind messages that end a transaction there (it is then told to the client ahead of their last ReadyForQuery). */
  private positionBehind(lend: Lend): Own {
    const set = this.o.replicas!.set
    let answer = ''
    lend.positionDue++
    this.verifying++ // (the transaction is decided once it is in)
    return {
      query: set.positionMessage(),
      onRow: (value) => (answer = value),
      ready: () => {
        this.verifying--
        lend.positionDue--
        this.seen.reached(set.primaryAnswer(answer))
        if (this.lend !== lend) return
        this.seen.tell()
        if (lend.tail && !lend.positionDue) this.deliver(lend, lend.tail), (lend.tail = undefined)
        this.afterOwn(lend)
      },
    }
  }

  /**
   * All the session sent is answered, where the position was left to ask then: asked if Postgres says
   * the session is idle and no group of the client's is half sent, else given up (a block still open
   * is followed by the position where it closes; a group begun runs on this backend and asks it at its Sync).
   */
  private positionAfter(lend: Lend) {
    const status = lend.watch.status
    if (status === undefined) return // (the last ReadyForQuery's status comes in the next chunk)
    lend.positionAfter = false
    lend.positionDue--
    if (lend.watch.settled === TxStatus.Idle) lend.relay.ownQuery(this.positionBehind(lend))
    else if (!lend.positionDue && lend.tail) this.deliver(lend, lend.tail), (lend.tail = undefined)
  }

  /** `owned`: they are the session's own copies (from its queue), not views of what the client sent. */
  private send(msgs: Buffer[], owned = false) {
    const lend = this.lend!
    const handover = lend.handover
    if (handover) {
      // Behind the reset, up to the first Sync: Postgres skips them all if it refuses the reset, and
      // nothing after that Sync may run before its answer says it did not. (Copies kept to send again
      // are bounded as a replica's are: past that, what follows waits in the queue, counted.)
      if (handover.synced) return this.queue(msgs)
      const sync = msgs.findIndex((m) => m[0] === ClientMessage.Sync)
      if (sync >= 0) this.queue(msgs.slice(sync + 1)), (msgs = msgs.slice(0, sync + 1)), (handover.synced = true)
      for (const m of msgs) handover.sent.push(owned ? m : kept(m)), (handover.bytes += m.length)
      if (handover.bytes > HOLD_MAX) handover.synced = true
    }
    if (!msgs.length) return
    // pg_cancel_backend / pg_terminate_backend of a processID the proxy told: for the session told it
    // (this one, perhaps), once Postgres has run the statement and its answer is on its way to the
    // client (Postgres signals while it runs; acting as it passed by ended targets before it ran).
    let answered = this.readies + lend.watch.pending
    // (Where Postgres last said the session was, if it has answered all that went before.)
    const status = lend.watch.pending === 0 ? lend.watch.status : undefined
    const settled = lend.watch.settled
    let read = NOTHING
    let bytes = 0
    for (const m of msgs) {
      const r = this.reading.of(m)
      read = merge(read, r)
      lend.watch.sent(m)
      bytes += m.length
      if (r.signals) this.signalsDue.add(m, r, answered + 1)
      if (m[0] === ClientMessage.Query || m[0] === ClientMessage.Sync) answered++
    }
    const on = lend.onReplica
    if (on?.retryable) {
      on.sent.push(...(owned ? msgs : msgs.map(kept)))
      on.sentBytes += bytes
      // (What may be sent again is bounded as what is held back is: past it, the read stays where it is.)
      if (on.sentBytes > HOLD_MAX) (on.retryable = false), (on.sent = []), this.release(lend)
    }
    const last = msgs[msgs.length - 1][0]
    const ends = last === ClientMessage.Sync || last === ClientMessage.Query
    const idle = settled === TxStatus.Idle
    if (idle && !lend.onReplica) this.o.replicas?.set.events.routed('primary') // (a replica's, once its answer stands: see release)
    // Where reads may go to replicas, a group that may end a transaction on the primary (one that does
    // not open a block, where Postgres's last word was idle, or that closes the block) is followed by
    // the position, in the same write. Where what went before is unanswered, or behind a COPY FROM
    // STDIN (which would take it for the copy's data), the position is asked once all is answered, if
    // the session is idle then (see fromBackend): never inside a block, where it would take the snapshot.
    let behind: Own[] | undefined
    if (this.o.replicas && !lend.onReplica && ends && read.block !== 'open') {
      if (read.copyIn || status === undefined) lend.positionAfter || ((lend.positionAfter = true), lend.positionDue++)
      else if (read.block === 'closed' || status === TxStatus.Idle) (behind = [this.positionBehind(lend)])
    }
    lend.effects = merge(lend.effects, read)
    if (!lend.relay.forward(msgs, false, behind) && behind) this.verifying--, lend.positionDue-- // (it did not go)
    this.pin.mayLeave(true) // (if pinned: what it runs may release what it keeps)
  }

  private acquire() {
    this.acquiring = true
    const route = this.o.replicas ? this.route(this.waiting) : 'primary'
    if (route === 'primary') return this.acquireOn(this.o.lender)
    const { set } = this.o.replicas!
    const replica = set.choose()
    if (typeof replica === 'string') return this.fellBack(replica)
    this.o.replicas!.lender(replica).then(
      (lender) => this.acquireOn(lender, { replica, sent: [], sentBytes: 0, held: [], heldBytes: 0, retryable: route === 'autocommit', checked: false }),
      (err: Error) => this.replicaFailed(replica, err)
    )
  }

  /**
   * No backend on `replica` for this session (`err`): a login Postgres refused there for what it asks
   * (its options, role or database) is this session's, which reads on the primary from now on; anything
   * else (no connection, a replica shutting down) passes the replica over a while, for all.
   */
  private replicaFailed(replica: Replica, err: Error) {
    if (err instanceof LoginRefused && !downForAll(err.code)) return (this.replicaRefused = true), this.fellBack('refused')
    this.o.replicas!.set.down(replica, err.message)
    this.fellBack('down')
  }

  /** What waits goes to the primary after all, for `why`. */
  private fellBack(why: Fallback) {
    this.o.replicas!.set.events.fellBack(why)
    this.acquireOn(this.o.lender)
  }

  private acquireOn(lender: Lender, onReplica?: OnReplica) {
    this.acquiring = true
    this.toPrimary = false
    this.askedOf = lender
    this.askedFor = onReplica
    lender.request(this.given, this.refused, this.inLine, this.holder)
  }

  /** Whose backend the session waits for (one request at a time: see acquiring), and for a replica's lend, what may still move it. */
  private askedOf?: Lender
  private askedFor?: OnReplica
  /** The backend given, until the microtask that begins the lend. */
  private givenBackend?: Backend
  // (Not at once: a backend may be given from within another session's handling of its backend's answer.)
  private readonly given = (backend: Backend) => void ((this.givenBackend = backend), soon(this.lent))
  private readonly refused = (err: Error & { code?: string }) => soon(() => this.notLent(err))
  private readonly inLine = (leave: (reason: Error) => void) => void (this.leaveLine = leave)

  private readonly lent = () => {
    const backend = this.givenBackend!
    const lender = this.askedOf!
    const onReplica = this.askedFor
    this.givenBackend = undefined
    this.leaveLine = undefined
    const { claims, replicas } = this.o
    // (On a standby, a token's claims lead the lend's first group: see begin.)
    if (claims === undefined || onReplica || this.ended) return this.begin(backend, lender, onReplica)
    // A login by token: its claims on the backend first (proxy/auth/claims.ts), and, where reads may go to replicas, the key that vouches for them there.
    setClaims(backend.upstream, claims).then(
      () => replicas?.claimsKey.learn(backend.upstream).then(() => this.begin(backend, lender)) ?? this.begin(backend, lender),
      (err: ClaimsError) => {
        lender.lost(backend) // (closed: it serves no one)
        this.refuseWaiting(err)
      }
    )
  }

  private notLent(err: Error & { code?: string }) {
    this.leaveLine = undefined
    const onReplica = this.askedFor
    if (onReplica && !this.ended) {
      // (Its backends all busy: this read only.)
      return err instanceof PoolTimeout ? this.fellBack('down') : this.replicaFailed(onReplica.replica, err)
    }
    this.refuseWaiting(err, `edgepg-proxy: ${err.message}`)
  }

  /** The backend is the session's now: what waited for it goes (unless the session ended meanwhile; on a replica, once it said it may serve). */
  private begin(backend: Backend, lender: Lender, onReplica?: OnReplica) {
    this.acquiring = false
    // (A read that waited already, without a backend, goes on counting from when it began to.)
    const { replayWait } = this
    this.replayWait = undefined
    if (this.ended) return lender.giveBack(backend)
    const handover = backend.user !== undefined && backend.user !== this.user
    if (handover) backend.resets++ // (DISCARD ALL drops its prepared statements)
    // (A backend the session did not use last lacks its settings: a reset one too.)
    const carried = backend.user !== this.user ? this.state.carried(!!onReplica) : undefined
    backend.user = this.user
    const lend = this.startLend(backend, lender, onReplica)
    // Ahead of the session's messages, in their group: the reset, the session's settings, and on a standby a token's claims (each lend: the session may have reset them).
    const claims = onReplica && this.o.claims !== undefined ? replicaClaimsMessages(this.o.claims, this.o.replicas!.claimsKey.key!) : undefined
    if (handover || carried || claims) {
      lend.handover = { sent: [], bytes: 0, synced: false }
      const reset = handover ? handoverReset() : undefined
      const ends = (reset ? HANDOVER_ENDS : 0) + (carried?.ends ?? 0) + (claims ? REPLICA_CLAIMS_ENDS : 0)
      const lead = carried || claims ? Buffer.concat([reset ?? EMPTY, carried?.bytes ?? EMPTY, claims ?? EMPTY]) : reset!
      lend.relay.lead(lead, ends, (ok) => this.handedOver(lend, ok, handover, !!claims, !!carried))
    }
    if (onReplica) {
      // Behind what the session has seen, as far as is known: its messages wait for the replica to replay it.
      const need = this.seen.need()
      if (need === undefined || onReplica.replica.replayed < need) (onReplica.gatedSince = replayWait?.since ?? performance.now()), (onReplica.behind = !!replayWait)
      this.checkReplica(lend, replayWait?.tries)
      if (onReplica.gatedSince !== undefined) return
    }
    this.send(this.unqueue(), true)
  }

  /**
   * Postgres answered the reset of a backend that changed hands: what waited behind it goes; or it
   * refused it (and skipped what came behind, up to a Sync), and the backend, which no reset cleans,
   * is closed and the session's messages go to another, unseen.
   */
  private handedOver(lend: Lend, ok: boolean, reset: boolean, claims: boolean, carried: boolean) {
    const sent = lend.handover!.sent
    lend.handover = undefined
    if (reset) this.o.lender.events.handedOver(ok ? 'reset' : 'refused')
    if (this.lend !== lend) return
    // (A standby that refused the session's claims or settings: it reads where they are set, on the primary.)
    if (!ok && (claims || (carried && lend.onReplica))) this.replicaRefused = true
    this.carryRefused = ok || !carried || lend.onReplica ? 0 : this.carryRefused + 1
    if (this.carryRefused > 1) {
      // (Refused twice running, on two backends: Postgres will not take the session's state any more, a privilege revoked say.)
      const names = this.state.carried()?.names.join(', ')
      return this.evict('upstream_error', '55000', `edgepg-proxy: the session's settings and prepared statements (${names}) could not be made again on another backend, as transaction pooling does for each transaction: the session is closed`)
    }
    if (!ok) return this.elsewhere(lend, sent)
    if (this.waiting.length && lend.onReplica?.gatedSince === undefined) this.send(this.unqueue(), true) // (a replica's, once caught up)
  }

  /** What the session sent on a lend that ran none of it, to another backend (the lend's is closed). */
  private elsewhere(lend: Lend, sent: Buffer[]) {
    this.detach(lend)
    lend.lender.lost(lend.backend) // (closed)
    this.signalsDue.forgetAfter(this.readies) // (their statements are sent again)
    this.waiting = [...sent, ...this.waiting]
    this.queued += sent.reduce((n, m) => n + m.length + QUEUED_COST, 0)
    if (!this.acquiring) this.acquire()
  }

  /**
   * Asks the replica how far it has replayed, ahead of the session's messages (no round trip of its
   * own, unless they wait for it): its answer decides whether what runs there may stand.
   */
  private checkReplica(lend: Lend, tries = 0) {
    const on = lend.onReplica!
    const { set } = this.o.replicas!
    let answer = ''
    set.events.checked()
    this.verifying++
    if (lend.handover) lend.handover.synced = true // (its Sync ends the group the reset leads)
    lend.relay.ownQuery({
      query: set.checkMessage(on.replica),
      onRow: (value) => (answer = value),
      ready: () => {
        this.verifying--
        if (this.lend !== lend || on.moving) return
        // (No answer: the check failed in this session, not the replica for all.)
        if (!answer) return (this.replicaRefused = true), this.move(lend, 'check_failed')
        const { replayed, serves, lagging } = set.observe(on.replica, answer)
        if (!serves) return this.move(lend, 'promoted')
        if (lagging) return this.move(lend, 'lag')
        const need = this.seen.need()
        if (need !== undefined && replayed >= need) {
          on.checked = true
          this.seen.reached(replayed)
          if (on.gatedSince !== undefined) {
            if (on.behind) set.events.waited((performance.now() - on.gatedSince) / 1000)
            on.gatedSince = undefined
            return this.send(this.unqueue(), true)
          }
          return this.release(lend)
        }
        // Behind: its messages wait (if they were sent, what they read is not what the session may see).
        const left = on.gatedSince === undefined ? 0 : on.gatedSince + set.o.waitMs - performance.now()
        if (left <= 0) return this.move(lend, 'position')
        this.awaitReplay(lend, on.gatedSince!, tries, left)
      },
    })
  }

  /**
   * The replica has not replayed what the session's read must see: its backend goes back (readers
   * sharing the key are not queued behind this one), and the read asks again after a while (recheckIn),
   * until --replica-wait has passed since it began.
   */
  private awaitReplay(lend: Lend, since: number, tries: number, left: number) {
    this.detach(lend)
    lend.lender.giveBack(lend.backend) // (it ran the proxy's check only)
    this.acquiring = true // (what the client sends meanwhile waits with it)
    this.replayWait = { since, tries: tries + 1 }
    this.replayTimer = setTimeout(() => {
      this.acquiring = false
      if (!this.ended) this.acquire()
    }, recheckIn(tries, left))
  }

  /**
   * What the replica answered goes to the client (the position first): once it has said it may
   * serve, and, for a read it may refuse as a write, once that read is over (or too large to hold).
   */
  private release(lend: Lend) {
    const on = lend.onReplica!
    const over = lend.watch.settled === TxStatus.Idle && !on.gatedSince
    if (!on.held || !on.checked || (on.retryable && !over && on.heldBytes <= HOLD_MAX)) return
    const held = on.held
    on.held = undefined
    this.o.replicas!.set.events.routed('replica')
    on.retryable = false
    on.sent = []
    this.seen.tell()
    for (const bytes of held) this.deliver(lend, bytes)
  }

  /**
   * The replica cannot serve what the session sent (`why`): once Postgres has answered it all, the
   * backend goes back and the messages go to the primary; the client has seen none of its answers.
   */
  private move(lend: Lend, why: Fallback) {
    const on = lend.onReplica!
    on.moving = why
    on.held = undefined
    if (lend.watch.pending === 0) this.moved(lend)
  }

  private moved(lend: Lend) {
    const on = lend.onReplica!
    this.detach(lend)
    lend.lender.endSession(lend.backend, this.ending(lend)) // (reset: nothing of it is the session's)
    this.toPrimaryAfter(on, on.moving!)
  }

  /** What the session sent on a replica's lend (or kept waiting for it), to the primary, ahead of anything sent since. */
  private toPrimaryAfter(on: OnReplica, why: Fallback) {
    if (on.gatedSince !== undefined) on.sent = this.unqueue()
    this.waiting = [...on.sent, ...this.waiting]
    this.queued += on.sent.reduce((n, m) => n + m.length + QUEUED_COST, 0)
    this.toPrimary = true
    this.fellBack(why)
  }

  /** No backend for what waits: each Query and Sync gets Postgres's way of saying no, an error and ReadyForQuery. */
  private refuseWaiting(err: Error & { code?: string }, message = err.message) {
    this.acquiring = false
    if (this.ended) return
    const answers = this.unqueue().filter((m) => m[0] === ClientMessage.Query || m[0] === ClientMessage.Sync).length
    for (let i = 0; i < answers; i++) this.toClient(Buffer.concat([errorResponse(err.code ?? '08006', message, 'ERROR'), READY_IDLE]))
    this.readies += answers
  }

  private startLend(backend: Backend, lender: Lender, onReplica?: OnReplica): Lend {
    const statements = statementsOn(backend, this.o.statementsPerBackend)
    const toBackend = (bytes: Buffer) => void (backend.upstream.write(bytes) || this.ws.pause())
    // (The last lend's relay and watch, if they ended with nothing under way, serve this one: a lend per statement.)
    const spare = this.spareRelay
    const watch = this.spareWatch
    this.spareRelay = this.spareWatch = undefined
    spare?.lendTo(statements, toBackend)
    watch?.reset()
    const relay = spare ?? new StatementRelay(this.statements, statements, toBackend, this.o.lender.events.preparedAgain)
    relay.onParameter = this.parameter
    const lend: Lend = (this.lend = { backend, lender, onReplica, delivered: 0, positionDue: 0, relay, watch: watch ?? new IdleWatch(), effects: NOTHING })
    lend.watch.framer = relay
    backend.upstream.onDrain = this.resumeClient
    backend.upstream.onClose = this.onBackendClose
    const early = backend.upstream.relay(this.fromBackend)
    backend.upstream.resume()
    if (early.length) this.fromBackend(early)
    return lend
  }

  // ── Postgres → client ───────────────────────────────────────────────────────────────────────

  private readonly fromBackend = (chunk: Buffer) => {
    const lend = this.lend
    if (!lend) return
    const visible = lend.relay.fromBackend(chunk)
    if (this.lend !== lend) return // (an answer of the proxy's own, read just now, moved the session on)
    const on = lend.onReplica
    // (A replica's lend whose transaction is over owes the client nothing: a FATAL now is the replica's going away.)
    if (on && !on.held && this.waitsOnReplica(lend)) return
    lend.watch.received(lend.relay.passedReadies, lend.relay.passedLast, lend.relay.passedStatus)
    if (on?.moving) return void (lend.watch.pending === 0 && this.moved(lend))
    if (on?.held) {
      if (visible.length) on.held.push(visible), (on.heldBytes += visible.length)
      if (on.retryable && refusedAsWrite(visible)) return this.move(lend, 'read_only')
      this.release(lend)
      if (on.held) return
    } else if (lend.positionDue && visible.length && lend.watch.last === ServerMessage.ReadyForQuery) {
      // The last ReadyForQuery so far waits for the position asked behind it (see positionBehind).
      const bytes = lend.tail ? Buffer.concat([lend.tail, visible]) : visible
      lend.tail = bytes.subarray(bytes.length - READY_IDLE.length)
      this.deliver(lend, bytes.subarray(0, bytes.length - READY_IDLE.length))
      if (lend.positionAfter && lend.watch.pending === 0) this.positionAfter(lend)
    } else if (visible.length) {
      if (lend.tail) this.deliver(lend, lend.tail), (lend.tail = undefined)
      this.deliver(lend, visible)
    }
    this.signalsDue.send(this.readies)
    // A parked backend speaks only to say it is going away (a FATAL): it stays with this session
    // (which ends as it closes), and no other may take it meanwhile.
    if (this.parked && lend.watch.last === ServerMessage.ErrorResponse) return lend.lender.unpark(lend.backend), void (this.parked = false)
    const settled = lend.watch.settled
    if (this.lend !== lend || settled === undefined || (this.waiting.length && !lend.onReplica)) return
    if (settled === TxStatus.Idle) this.transactionEnded(lend)
    else this.idleInside()
  }

  /** Nothing runs and the client sends nothing, inside a transaction: it may stay so for --idle-in-transaction-timeout. */
  private idleInside() {
    this.pin.mayLeave(false) // (what it runs is over; its transaction is not)
    if (this.idleInTx) return
    this.idleInTx = true
    this.lend?.lender.idleInTransaction() // (another client may be waiting for this backend)
    const ms = this.o.idleInTransactionMs
    if (!ms) return
    this.idleInTransaction = setTimeout(() => {
      const message = `terminating connection due to idle-in-transaction timeout (edgepg-proxy: --idle-in-transaction-timeout ${ms} ms; the transaction was rolled back)`
      this.evict('idle_in_transaction', '25P03', message)
    }, ms)
  }

  /**
   * Ends the session as Postgres ends a connection it will not keep: a FATAL error, then the close.
   * Its backend is reset by the pool (rolled back first), or closed if it is busy or holds what no reset takes.
   */
  private evict(kind: OutcomeKind, code: string, message: string) {
    this.end(kind, message)
    this.toClient(errorResponse(code, message, 'FATAL'))
    this.finish()
    closeWebSocket(this.ws, 1000)
  }

  /** Postgres's answers of a lend to the client, counting its ReadyForQuery messages. */
  private deliver(lend: Lend, bytes: Buffer) {
    const readies = lend.watch.readies
    this.readies += readies - lend.delivered
    lend.delivered = readies
    if (bytes.length) this.toClient(bytes)
  }

  private readonly resumeBackend = () => this.lend?.backend.upstream.resume()
  private toClient(chunk: Buffer) {
    this.o.onActivity?.()
    this.bytesOut += chunk.length
    const congested = this.ws.bufferedAmount + chunk.length > HIGH_WATER
    this.ws.send(chunk, congested ? this.resumeBackend : undefined)
    if (congested) this.lend?.backend.upstream.pause()
  }

  /**
   * A transaction is over: the backend stays with the session while no other needs it, and goes on
   * (to be reset by its next taker) unless the session keeps it for state it made: a transaction that
   * did more than plain reads and writes, by the parser or by Postgres's command tags, is followed by
   * the backend's own account of what is left. (A replica's read is plain: what code left there is
   * the next taker's reset's.) A backend the session keeps anyway is not asked.
   */
  private transactionEnded(lend: Lend) {
    if (this.parked || this.verifying) return
    const e = lend.effects
    const plain = (e.plain && !lend.relay.unusual) || !!lend.onReplica
    lend.effects = NOTHING
    lend.relay.unusual = false
    if (e.unseen && lend.onReplica) {
      // (No session keeps a standby's backend: one left with what no reset takes is closed, and the session reads on.)
      this.detach(lend)
      lend.lender.endSession(lend.backend, this.ending(lend, false))
      return void (this.waiting.length && !this.acquiring && this.acquire())
    }
    if (e.unseen) (this.pin.forGood = true), this.pin.pin('unseen')
    if (this.pin.forGood || (this.pin.reason && plain)) return this.pin.mayLeave(false)
    if (plain) return this.lendOn(lend)
    lend.relay.ownQuery(this.verification(lend))
    this.verifying++
    this.o.lender.events.verified()
    this.pin.mayLeave(true) // (if pinned: until the answer)
  }

  /**
   * Asks the backend what the transaction left, in messages of the proxy's own behind the client's
   * answer (no round trip of its own). The session keeps the backend meanwhile; the transaction is
   * then decided on the answer (or, if the session has begun another, with it).
   */
  private verification(lend: Lend): Own {
    const rows: string[] = []
    const ready = (status: number) => {
      this.verifying--
      if (this.lend === lend) {
        // (Asked inside a transaction, the answer says nothing of what the transaction will leave.)
        const f = status === TxStatus.Idle ? found(rows) : undefined
        const stays = f && this.state.learn(f)
        const statements = statementsOn(lend.backend, this.o.statementsPerBackend).held.size
        const left = f ? (f.left[0] ?? stays ?? (f.statements > statements ? 'statements' : undefined)) : 'unverified'
        if (left) this.pin.pin(left)
        else this.pin.unpin(), this.afterOwn(lend)
      }
      this.pin.mayLeave(this.lend === lend && lend.watch.pending > 0)
    }
    return { query: this.o.lender.verification, onRow: (value) => rows.push(value), ready }
  }

  /** An answer of the proxy's own is in: the transaction, if it is over, is decided now. */
  private afterOwn(lend: Lend) {
    if (!this.verifying && lend.watch.settled === TxStatus.Idle && (!this.waiting.length || lend.onReplica)) this.transactionEnded(lend)
  }

  /** A transaction that left nothing: the backend stays with this session while no other needs it, else goes back. */
  private lendOn(lend: Lend) {
    // (A replica's is not parked: the session's next transaction may be a write, or need a later position.)
    if (!lend.onReplica && lend.lender.park(lend.backend, this.surrender)) return void (this.parked = true)
    this.detach(lend)
    lend.lender.giveBack(lend.backend)
    if (this.waiting.length && !this.acquiring) this.acquire() // (what came while a replica's lend ended)
  }

  /** The parked backend goes back: the session's next transaction runs elsewhere. */
  private surrenderParked() {
    const lend = this.lend!
    this.parked = false
    this.detach(lend)
    lend.lender.giveBack(lend.backend)
  }

  /** Another session takes the parked backend: from now on this one acquires anew. */
  private readonly surrender = () => {
    this.parked = false
    if (this.lend) this.detach(this.lend)
  }

  private readonly resumeClient = () => this.ws.resume()
  /** The relay and watch of a lend that ended with nothing under way, for the next (see startLend). */
  private spareRelay?: StatementRelay
  private spareWatch?: IdleWatch

  private detach(lend: Lend) {
    if (lend.relay.quiet && lend.watch.quiet) (this.spareRelay = lend.relay), (this.spareWatch = lend.watch)
    this.verifying = 0 // (theirs are the backend's: answered there, or lost with it)
    this.pin.mayLeave(false)
    lend.backend.upstream.onDrain = undefined
    lend.backend.upstream.onClose = undefined
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
    if (lend.handover) return this.elsewhere(lend, lend.handover.sent) // (nothing of the session's ran there)
    const on = lend.onReplica
    if (on && (on.held || on.gatedSince !== undefined || this.waitsOnReplica(lend))) {
      // A replica went away under a read the client has seen nothing of (or after it): the primary serves.
      this.o.replicas!.set.down(on.replica, 'the connection was lost')
      this.detach(lend)
      lend.lender.lost(lend.backend)
      if (this.waitsOnReplica(lend) && on.gatedSince === undefined) return void (this.waiting.length && !this.acquiring && this.acquire())
      return this.toPrimaryAfter(on, 'down')
    }
    this.detach(lend)
    lend.lender.lost(lend.backend)
    this.parked = false
    if (lend.watch.last === ServerMessage.ErrorResponse) {
      this.end('ok', 'closed by upstream')
      return closeWebSocket(this.ws, 1000)
    }
    if (this.pin.reason) {
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
    clearTimeout(this.idleInTransaction)
    clearTimeout(this.replayTimer)
    this.signalsDue.send(this.readies, Infinity) // (the statements ran: Postgres would have signalled)
    this.unsignal()
    this.pin.unpin()
    this.waiting = []
    this.leaveLine?.(new Error('the session ended'))
    this.unfollow()
    const lend = this.lend
    if (!lend) return
    this.detach(lend)
    if (this.parked) return lend.lender.giveBack(lend.backend)
    lend.lender.endSession(lend.backend, this.ending(lend, !this.pin.forGood))
  }

  /** How a lend's backend is left: the reset waits out what Postgres still owes, the session's answers and the proxy's own. */
  private ending(lend: Lend, reusable = true): Ending | undefined {
    const ending = lend.watch.ending
    return ending && { ...ending, pending: ending.pending + lend.relay.ownReadiesDue, reusable: ending.reusable && reusable }
  }
}

const READY_IDLE = Buffer.from([ServerMessage.ReadyForQuery, 0, 0, 0, 5, TxStatus.Idle])
