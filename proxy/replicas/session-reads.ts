/**
 * A session's reads on hot standbys (transaction pooling), what decides them: where a transaction's
 * first messages go (routeOf), and how far the session has seen, which its reads must not go behind
 * (SessionSeen): the primary's positions after its transactions there, the replicas' after its reads
 * there, and the positions its client says it has seen (SUBPROTOCOL_POSITIONS and _FRAMED); and
 * what a read on a replica holds while it may still move to the primary (OnReplica).
 */
import type { WebSocket } from 'ws'
import { merge, NOTHING, type Reading } from '../isolation/reader'
import { ClientMessage, INERT, ServerMessage } from '../wire/codes'
import { cString } from '../wire/startup'
import { later } from '../../src/positions'
import { lsnText, positionOf } from './positions'
import type { Fallback, Replica, Replicas } from './replicas'
import type { Lender } from '../pool/lender'
import type { ReplicaKeyCache } from '../auth/claims'
import { POSITION_MESSAGE, SUBPROTOCOL_POSITIONS, SUBPROTOCOL_POSITIONS_FRAMED } from '../../src/config'

/** The most a client's positions may take (a position per database it has written to), in a frame or a message. */
export const POSITIONS_MAX = 1024

/**
 * Where messages that start a transaction may go: a replica for one begun read-only (or any, where
 * every transaction of the session is: `readOnly`), and for an autocommit read that leaves nothing
 * behind (`autocommit`: one the standby may refuse as a write, 25006, and is then sent to the
 * primary); else the primary. Named statements stay on the primary, as does what sets session state.
 */
export function routeOf(msgs: Buffer[], read: (sql: string) => Reading, readOnly: boolean, autocommit: boolean): 'primary' | 'replica' | 'autocommit' {
  let first: Reading | undefined
  let all = NOTHING
  for (const m of msgs) {
    const type = m[0]
    if (type === ClientMessage.Query || type === ClientMessage.Parse) {
      if (type === ClientMessage.Parse && m[5] !== 0) return 'primary' // (a named statement)
      const r = read(cString(m.subarray(type === ClientMessage.Query ? 5 : 6)))
      first ??= r
      all = merge(all, r)
    } else if (type === ClientMessage.Bind) {
      if (m[m.indexOf(0, 5) + 1] !== 0) return 'primary' // (a named statement)
    } else if (!INERT.has(type) || type === ClientMessage.CopyData) return 'primary'
  }
  if (!first || !all.plain || all.unseen || all.signals) return 'primary'
  if (first.begins === 'read-only' || readOnly) return first.begins === 'other' ? 'primary' : 'replica'
  const last = msgs[msgs.length - 1][0]
  const whole = last === ClientMessage.Sync || last === ClientMessage.Query
  return autocommit && whole && !all.writes && !all.control ? 'autocommit' : 'primary'
}

/** How far a session has seen, by the positions of the primary's WAL, and what its client is told of it. */
export class SessionSeen {
  /** The furthest position the session has seen (0: none yet). */
  at = 0n
  private told = 0n
  /** What the client last said it has seen (positions text), and that read for the primary's database. */
  private after = ''
  private afterAt?: bigint

  constructor(private readonly ws: WebSocket, private readonly set?: Replicas) {}

  /** The session has seen `position` (the primary's after a transaction, a replica's after a read). */
  reached(position: bigint | undefined) {
    if (position !== undefined && position > this.at) this.at = position
  }

  /** `after <positions>` (SUBPROTOCOL_POSITIONS_FRAMED): what the client has seen. False: not such a frame. */
  afterFrame(data: Buffer): boolean {
    if (this.ws.protocol !== SUBPROTOCOL_POSITIONS_FRAMED || data.length > POSITIONS_MAX || data.toString('latin1', 0, 6) !== 'after ') return false
    this.byClient(data.toString('latin1', 6))
    return true
  }

  /** The same in the client's stream (SUBPROTOCOL_POSITIONS): its position messages, taken out of what goes to Postgres; undefined if one is too long. */
  takePositions(msgs: Buffer[]): Buffer[] | undefined {
    const rest: Buffer[] = []
    for (const m of msgs) {
      if (m[0] !== POSITION_MESSAGE) rest.push(m)
      else if (m.length > POSITIONS_MAX) return undefined
      else this.byClient(m.toString('latin1', 5, m.length - 1))
    }
    return rest
  }

  private byClient(positions: string) {
    this.after = positions
    this.afterAt = undefined
  }

  /** The position the session's reads must not go behind; undefined when it cannot be known (the client names positions, and the primary's database is not known yet). */
  need(): bigint | undefined {
    const database = this.set?.database
    if (!database) return later(this.after) ? undefined : this.at
    const theirs = (this.afterAt ??= positionOf(this.after, database))
    return theirs > this.at ? theirs : this.at
  }

  /** `seen <position>`: the client learns how far the session has seen, before the ReadyForQuery it came with. */
  tell() {
    const database = this.set?.database
    if (!database || this.at <= this.told || this.ws.protocol !== SUBPROTOCOL_POSITIONS) return
    this.told = this.at
    this.ws.send(`seen ${database}:${lsnText(this.at)}`)
  }
}

/** What a session whose login the standbys can serve reads through: the set, its key's lender on each, and what its login says. */
export interface SessionReplicas {
  set: Replicas
  /** The session's key's lender on `replica` (its first login made if need be); LoginRefused if the replica refused the login. */
  lender(replica: Replica): Promise<Lender>
  /** Every transaction of the session starts read-only (default_transaction_read_only in its login). */
  readOnly: boolean
  /** For a session by token: the replica key its claims are vouched for with there, once learnt on the primary. */
  claimsKey: ReplicaKeyCache
}

/** A session's lend on a replica: what may still move it to the primary, unseen by the client. */
export interface OnReplica {
  replica: Replica
  /** The session's messages sent on it: sent to the primary instead if the replica cannot serve them. */
  sent: Buffer[]
  sentBytes: number
  /** Answers held back from the client while the lend may still move; undefined once released. */
  held?: Buffer[]
  heldBytes: number
  /** An autocommit read, which the standby may refuse as a write (25006): it moves then. False for a transaction begun read-only. */
  retryable: boolean
  /** The replica said it has replayed what the session has seen. */
  checked: boolean
  /** The session's messages wait for that, since (ms); and whether it was found behind it (a wait, for the metrics). */
  gatedSince?: number
  behind?: boolean
  /** Moving to the primary (why), once Postgres has answered what was sent. */
  moving?: Fallback
}

/** Answers a read on a replica holds back while it may still move to the primary; past this, it goes to the client and stays. */
export const HOLD_MAX = 64 << 10

/** Whether answers hold a standby's refusal of a write (25006, read_only_sql_transaction). */
export function refusedAsWrite(bytes: Buffer): boolean {
  for (let at = 0; at + 5 <= bytes.length; at += 1 + bytes.readInt32BE(at + 1)) {
    if (bytes[at] === ServerMessage.ErrorResponse && bytes.subarray(at, at + 1 + bytes.readInt32BE(at + 1)).includes('\0C25006\0')) return true
  }
  return false
}
