/**
 * A lent session's reads on hot standbys (proxy/replicas/): where its next transaction goes, the
 * check that leads each lend on a replica and what waits for its answer, the primary's position asked
 * behind what ends a transaction there, and the ways back to the primary. The session relays
 * (proxy/ws/lent-session.ts); this decides, through its ReadsHost.
 */
import type { WebSocket } from 'ws'
import type { Ending } from '../pool/idle-watch'
import { LoginRefused, PoolTimeout, type Lender } from '../pool/lender'
import type { Own } from '../pool/prepared'
import type { Reading } from '../isolation/reader'
import { replicaClaimsMessages } from '../auth/claims'
import { kept } from '../wire/bytes'
import { ServerMessage, TxStatus } from '../wire/codes'
import { downForAll, recheckIn, type Fallback, type Replica } from '../replicas/replicas'
import { HOLD_MAX, refusedAsWrite, routeOf, SessionSeen, type OnReplica, type SessionReplicas } from '../replicas/session-reads'
import { READY_IDLE, type Lend } from './lend'

/** What of the session its reads act through. */
export interface ReadsHost {
  readonly lend?: Lend
  readonly ended: boolean
  /** A backend is being asked for (one request at a time). */
  acquiring: boolean
  /** Answers of the proxy's own still due on the lend: its transaction is decided once they are in. */
  verifying: number
  /** The session's key's lender on the primary. */
  readonly lender: Lender
  /** It keeps its backend for state it made: its reads stay where that is. */
  pinned(): boolean
  send(msgs: Buffer[], owned?: boolean): void
  deliver(lend: Lend, bytes: Buffer): void
  /** What waits for a backend, taken out of the queue. */
  unqueue(): Buffer[]
  /** `msgs` (the session's own copies) go first, ahead of what waits. */
  requeue(msgs: Buffer[]): void
  detach(lend: Lend): void
  acquire(): void
  acquireOn(lender: Lender, onReplica?: OnReplica): void
  /** What waits, if anything, asks for a backend. */
  next(): void
  ending(lend: Lend): Ending | undefined
  /** An answer of the proxy's own is in. */
  afterOwn(lend: Lend): void
}

/**
 * A replica's lend takes no new messages while it waits to catch up, nor once its transaction is
 * over (its verification may still be under way): they are routed afresh, when it is given back.
 */
export const waitsOnReplica = (lend: Lend): boolean => !!lend.onReplica && (lend.onReplica.gatedSince !== undefined || lend.watch.settled === TxStatus.Idle)

export class LentReads {
  /** How far the session has seen: its reads must not go behind that. */
  readonly seen: SessionSeen
  /** What waits goes to the primary: a replica could not serve it. */
  private toPrimary = false
  /** A replica could not run the session's check (its login's settings forbid it there: serializable by default), or refused its claims or settings: its reads stay on the primary. */
  refused = false
  /** A read waits for a replica to replay what the session has seen, with no backend meanwhile: since when, and how often it asked. */
  private replayWait?: { since: number; tries: number }
  private replayTimer?: NodeJS.Timeout

  constructor(ws: WebSocket, private readonly host: ReadsHost, private readonly replicas?: SessionReplicas, private readonly claims?: string) {
    this.seen = new SessionSeen(ws, replicas?.set)
  }

  /**
   * Where messages that start a transaction go (proxy/replicas/session-reads.ts): the primary once a
   * replica could not serve the session, while it is pinned, and for a session by token until the
   * replica key for its claims is learnt (see LentSession.lent).
   */
  route(msgs: Buffer[]): 'primary' | 'replica' | 'autocommit' {
    const replicas = this.replicas
    if (!replicas || this.toPrimary || this.refused || this.host.pinned() || (this.claims !== undefined && !replicas.claimsKey.key)) return 'primary'
    return routeOf(msgs, this.host.lender.read, replicas.readOnly, replicas.set.o.autocommit)
  }

  /** A backend for what waits (`waiting`), where its route says. */
  acquire(waiting: Buffer[]) {
    const route = this.route(waiting)
    if (route === 'primary') return this.host.acquireOn(this.host.lender)
    const { set } = this.replicas!
    const replica = set.choose()
    if (typeof replica === 'string') return this.fellBack(replica)
    this.replicas!.lender(replica).then(
      (lender) => this.host.acquireOn(lender, { replica, sent: [], sentBytes: 0, held: [], heldBytes: 0, retryable: route === 'autocommit', checked: false }),
      (err: Error) => this.failed(replica, err)
    )
  }

  /** A lend is asked for: on the primary, what waits stays there only as far as the lend goes. */
  asked() {
    this.toPrimary = false
  }

  /** No backend on the replica a read was meant for (`err`): on the primary. */
  notLent(on: OnReplica, err: Error) {
    // (Its backends all busy: this read only.)
    err instanceof PoolTimeout ? this.fellBack('down') : this.failed(on.replica, err)
  }

  /**
   * No backend on `replica` for this session (`err`): a login Postgres refused there for what it asks
   * (its options, role or database) is this session's, which reads on the primary from now on; anything
   * else (no connection, a replica shutting down) passes the replica over a while, for all.
   */
  private failed(replica: Replica, err: Error) {
    if (err instanceof LoginRefused && !downForAll(err.code)) return (this.refused = true), this.fellBack('refused')
    this.replicas!.set.down(replica, err.message)
    this.fellBack('down')
  }

  /** What waits goes to the primary after all, for `why`. */
  private fellBack(why: Fallback) {
    this.replicas!.set.events.fellBack(why)
    this.host.acquireOn(this.host.lender)
  }

  /** On a standby, a token's claims lead the lend's first group (each lend: the session may have reset them). */
  claimsLead(lend: Lend): Buffer | undefined {
    return lend.onReplica && this.claims !== undefined ? replicaClaimsMessages(this.claims, this.replicas!.claimsKey.key!) : undefined
  }

  /**
   * A lend begins: on a replica, the check leads it, and the session's messages wait for its answer
   * while the replica is behind what the session has seen (as far as is known). True: they wait.
   */
  begun(lend: Lend): boolean {
    // (A read that waited already, without a backend, goes on counting from when it began to.)
    const { replayWait } = this
    this.replayWait = undefined
    const on = lend.onReplica
    if (!on) return false
    const need = this.seen.need()
    if (need === undefined || on.replica.replayed < need) (on.gatedSince = replayWait?.since ?? performance.now()), (on.behind = !!replayWait)
    this.check(lend, replayWait?.tries)
    return on.gatedSince !== undefined
  }

  /** The session's messages went on a replica's lend: copies kept while they may go to the primary instead. */
  sent(lend: Lend, msgs: Buffer[], bytes: number, owned: boolean) {
    const on = lend.onReplica!
    if (!on.retryable) return
    on.sent.push(...(owned ? msgs : msgs.map(kept)))
    on.sentBytes += bytes
    // (What may be sent again is bounded as what is held back is: past it, the read stays where it is.)
    if (on.sentBytes > HOLD_MAX) (on.retryable = false), (on.sent = []), this.release(lend)
  }

  /**
   * On the primary, a group that may end a transaction (one that does not open a block, where
   * Postgres's last word, `status`, was idle, or that closes the block) is followed by the position,
   * in the same write. Where what went before is unanswered, or behind a COPY FROM STDIN (which would
   * take it for the copy's data), the position is asked once all is answered, if the session is idle
   * then (see answeredAll): never inside a block, where it would take the snapshot.
   */
  behind(lend: Lend, read: Reading, ends: boolean, status: number | undefined): Own[] | undefined {
    if (!this.replicas || lend.onReplica || !ends || read.block === 'open') return undefined
    if (read.copyIn || status === undefined) return void (lend.positionAfter || ((lend.positionAfter = true), lend.positionDue++))
    if (read.block === 'closed' || status === TxStatus.Idle) return [this.position(lend)]
    return undefined
  }

  /** What `behind` asked for did not go. */
  unsent(lend: Lend) {
    this.host.verifying--
    lend.positionDue--
  }

  /** The primary's position, asked behind messages that end a transaction there (it is then told to the client ahead of their last ReadyForQuery). */
  private position(lend: Lend): Own {
    const set = this.replicas!.set
    let answer = ''
    lend.positionDue++
    this.host.verifying++ // (the transaction is decided once it is in)
    return {
      query: set.positionMessage(),
      onRow: (value) => (answer = value),
      ready: () => {
        this.host.verifying--
        lend.positionDue--
        this.seen.reached(set.primaryAnswer(answer))
        if (this.host.lend !== lend) return
        this.seen.tell()
        if (lend.tail && !lend.positionDue) this.host.deliver(lend, lend.tail), (lend.tail = undefined)
        this.host.afterOwn(lend)
      },
    }
  }

  /** Answers of a lend on the primary to the client: while a position is asked behind them, their last ReadyForQuery waits for it. */
  deliver(lend: Lend, visible: Buffer) {
    if (lend.positionDue && lend.watch.last === ServerMessage.ReadyForQuery) {
      const bytes = lend.tail ? Buffer.concat([lend.tail, visible]) : visible
      lend.tail = bytes.subarray(bytes.length - READY_IDLE.length)
      this.host.deliver(lend, bytes.subarray(0, bytes.length - READY_IDLE.length))
      if (lend.positionAfter && lend.watch.pending === 0) this.answeredAll(lend)
      return
    }
    if (lend.tail) this.host.deliver(lend, lend.tail), (lend.tail = undefined)
    this.host.deliver(lend, visible)
  }

  /**
   * All the session sent is answered, where the position was left to ask then: asked if Postgres says
   * the session is idle and no group of the client's is half sent, else given up (a block still open
   * is followed by the position where it closes; a group begun runs on this backend and asks it at its Sync).
   */
  private answeredAll(lend: Lend) {
    const status = lend.watch.status
    if (status === undefined) return // (the last ReadyForQuery's status comes in the next chunk)
    lend.positionAfter = false
    lend.positionDue--
    if (lend.watch.settled === TxStatus.Idle) lend.relay.ownQuery(this.position(lend))
    else if (!lend.positionDue && lend.tail) this.host.deliver(lend, lend.tail), (lend.tail = undefined)
  }

  /**
   * Postgres's answer on a replica's lend that may still move, or is moving: held back from the client
   * until the lend stands. True: nothing more of it is the session's to handle now.
   */
  answered(lend: Lend, visible: Buffer): boolean {
    const on = lend.onReplica!
    if (on.moving) return lend.watch.pending === 0 && this.moved(lend), true
    if (visible.length) on.held!.push(visible), (on.heldBytes += visible.length)
    if (on.retryable && refusedAsWrite(visible)) return this.move(lend, 'read_only'), true
    this.release(lend)
    return !!on.held
  }

  /**
   * Asks the replica how far it has replayed, ahead of the session's messages (no round trip of its
   * own, unless they wait for it): its answer decides whether what runs there may stand.
   */
  private check(lend: Lend, tries = 0) {
    const on = lend.onReplica!
    const { set } = this.replicas!
    let answer = ''
    set.events.checked()
    this.host.verifying++
    if (lend.handover) lend.handover.synced = true // (its Sync ends the group the reset leads)
    lend.relay.ownQuery({
      query: set.checkMessage(on.replica),
      onRow: (value) => (answer = value),
      ready: () => {
        this.host.verifying--
        if (this.host.lend !== lend || on.moving) return
        // (No answer: the check failed in this session, not the replica for all.)
        if (!answer) return (this.refused = true), this.move(lend, 'check_failed')
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
            return this.host.send(this.host.unqueue(), true)
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
    const host = this.host
    host.detach(lend)
    lend.lender.giveBack(lend.backend) // (it ran the proxy's check only)
    host.acquiring = true // (what the client sends meanwhile waits with it)
    this.replayWait = { since, tries: tries + 1 }
    this.replayTimer = setTimeout(() => {
      host.acquiring = false
      if (!host.ended) host.acquire()
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
    this.replicas!.set.events.routed('replica')
    on.retryable = false
    on.sent = []
    this.seen.tell()
    for (const bytes of held) this.host.deliver(lend, bytes)
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
    this.host.detach(lend)
    lend.lender.endSession(lend.backend, this.host.ending(lend)) // (reset: nothing of it is the session's)
    this.toPrimaryAfter(on, on.moving!)
  }

  /** What the session sent on a replica's lend (or kept waiting for it), to the primary, ahead of anything sent since. */
  private toPrimaryAfter(on: OnReplica, why: Fallback) {
    this.host.requeue(on.gatedSince !== undefined ? this.host.unqueue() : on.sent)
    this.toPrimary = true
    this.fellBack(why)
  }

  /**
   * The replica went away under a lend: a read the client has seen nothing of (or that was over)
   * goes on on the primary. False: the client saw its answers; the session handles it as the primary's.
   */
  lost(lend: Lend): boolean {
    const on = lend.onReplica!
    if (!on.held && on.gatedSince === undefined && !waitsOnReplica(lend)) return false
    this.replicas!.set.down(on.replica, 'the connection was lost')
    this.host.detach(lend)
    lend.lender.lost(lend.backend)
    if (waitsOnReplica(lend) && on.gatedSince === undefined) return this.host.next(), true
    this.toPrimaryAfter(on, 'down')
    return true
  }

  /** The session is over. */
  end() {
    clearTimeout(this.replayTimer)
  }
}
