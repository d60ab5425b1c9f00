/**
 * Hot standbys of the upstream (--replica), and what the proxy knows of each: where it has replayed
 * the primary's WAL to, how far behind it runs, and whether it serves. Nothing polls them: every
 * read sent to one asks first, in the same write (REPLAY_CHECK), and its answer says whether the
 * read may stand. A replica that is down, refuses logins, lags more than --replica-max-lag or no
 * longer recovers (promoted) is passed over for a while; reads then go to the primary.
 */
import { serialize } from 'pg-protocol'
import { ReplicaKeyCache } from '../auth/claims'
import { lsn } from './positions'
import { parseHostPort, type HostPort } from '../upstream/address'
import { parseStartupParams } from '../wire/startup'

export interface ReplicaOptions {
  /** Hot standbys of the upstream, `host:port`. */
  addresses: string[]
  /** Pass over a replica whose replay lags more (ms). */
  maxLagMs: number
  /** How long a read waits for a replica to replay what its session has seen before it goes to the primary (ms). */
  waitMs: number
  /** Send autocommit reads to replicas (not only transactions begun read-only). */
  autocommit: boolean
}

/** Why a read went to the primary after all (the metric's label). */
export const FALLBACKS = ['none_usable', 'lag', 'down', 'read_only', 'position', 'promoted', 'check_failed', 'refused'] as const
export type Fallback = (typeof FALLBACKS)[number]

/**
 * Whether a login a replica refused with SQLSTATE `code` says it serves no one now (it shuts down,
 * starts up or crashed: class 57), not that it refuses this login (its options, role or database).
 */
export const downForAll = (code: string) => code.startsWith('57')

export interface ReplicaEvents {
  /** A lend went to `target`. */
  routed(target: 'primary' | 'replica'): void
  /** A read waited this long for a replica to replay its session's position. */
  waited(seconds: number): void
  fellBack(why: Fallback): void
  /** A check was asked of a replica. */
  checked(): void
  /** What a check said of a replica. */
  observed(name: string, lagSeconds: number, up: boolean): void
}

/**
 * How long a read waiting for a replica to replay its session's position waits, with no backend held,
 * before it asks again: twice as long each time, 10 ms up to 160 ms, never past --replica-wait (`left`).
 */
export const recheckIn = (tries: number, left: number) => Math.min(left, 10 << Math.min(tries, 4))

/** How long a replica that failed is passed over before it is tried again. */
const DOWN_MS = 2000

export class Replica {
  readonly target: HostPort
  /** Replayed up to here, as its last check said (-1: never checked). */
  replayed = -1n
  lagMs = 0
  /** When a check last said so (a lag is believed for DOWN_MS: only a check, made when a read goes there, tells it again). */
  checkedAt = 0
  /** Passed over until then. */
  downUntil = 0
  why?: string
  /** Its system identifier, once a check said it: a replica of another cluster is no replica. */
  database?: string
  constructor(readonly name: string) {
    this.target = parseHostPort(name)
  }
}

export class Replicas {
  readonly list: Replica[]
  /** The primary's system identifier, once a position asked of it said it. */
  database?: string
  private turn = 0
  private readonly claimsKeys = new Map<string, ReplicaKeyCache>()

  constructor(readonly o: ReplicaOptions, readonly events: ReplicaEvents) {
    this.list = o.addresses.map((a) => new Replica(a))
  }

  /** The next replica in turn that serves and keeps up, or why there is none. */
  choose(): Replica | Fallback {
    let why: Fallback = 'none_usable'
    const now = Date.now()
    for (let i = 0; i < this.list.length; i++) {
      const replica = this.list[(this.turn + i) % this.list.length]
      if (replica.downUntil > now) why = 'down'
      else if (replica.lagMs > this.o.maxLagMs && now - replica.checkedAt < DOWN_MS) why = why === 'down' ? why : 'lag'
      else return (this.turn = (this.turn + i + 1) % this.list.length), replica
    }
    return why
  }

  /** The replica key for token sessions' claims of `role` on `database` (proxy/auth/claims.ts), as far as it is learnt: WebSocket sessions and /sql share it. */
  claimsKey(role: string, database: string): ReplicaKeyCache {
    const name = `${role}\0${database}`
    let cache = this.claimsKeys.get(name)
    if (!cache) this.claimsKeys.set(name, (cache = new ReplicaKeyCache()))
    return cache
  }

  down(replica: Replica, why: string) {
    replica.downUntil = Date.now() + DOWN_MS
    replica.why = why
    this.events.observed(replica.name, replica.lagMs / 1000, false)
  }

  /**
   * The check asked of a replica: what it says, whether it may serve reads (it recovers, and from our
   * primary), and whether it lags more than --replica-max-lag (then no read stands there).
   */
  observe(replica: Replica, answer: string): { replayed: bigint; serves: boolean; lagging?: boolean } {
    const [position, recovering, lag, database] = answer.split(' ')
    if (database) replica.database = database
    // (Until the primary has said its own, a replica's stands for it: a primary that says otherwise passes it over.)
    this.database ??= replica.database
    const replayed = lsn(position ?? '') ?? -1n
    const serves = recovering === 't' && replayed >= 0n && (!this.database || !replica.database || replica.database === this.database)
    if (!serves) {
      this.down(replica, recovering !== 't' ? 'it is not in recovery (promoted?)' : 'it replicates another cluster')
      return { replayed, serves }
    }
    if (replayed > replica.replayed) replica.replayed = replayed
    // (-1: WAL received and not replayed, with no replay time to measure by: behind, by how much unknown.)
    const lagMs = lag === '-1' ? Infinity : Number(lag) || 0
    // (Every read checks: the metrics hear of a change only.)
    if (lagMs !== replica.lagMs || replica.downUntil || !replica.checkedAt) this.events.observed(replica.name, lagMs / 1000, true)
    replica.lagMs = lagMs
    replica.checkedAt = Date.now()
    replica.downUntil = 0
    return { replayed, serves, lagging: lagMs > this.o.maxLagMs }
  }

  /** A position asked of the primary: its system identifier (asked the first time), and the position. */
  primaryAnswer(answer: string): bigint | undefined {
    const [position, database] = answer.split(' ')
    if (database) this.database = database
    for (const replica of this.list) if (database && replica.database && replica.database !== database) this.down(replica, 'it replicates another cluster')
    return lsn(position ?? '')
  }

  /**
   * Asked of a replica ahead of a read: its replay position, whether it recovers, its lag in ms (0 when
   * it has replayed all it received; else the age of the last transaction it replayed; -1 when it has
   * replayed none since it started: unknown), and its system identifier the first time.
   */
  check(replica: Replica): string {
    return replica.database ? CHECK : CHECK_FIRST
  }

  /** Asked of the primary behind a transaction: where its WAL is, and its system identifier the first time. */
  position(): string {
    return this.database ? POSITION : POSITION_FIRST
  }

  /** The check as a Query message (made once: one goes with every read). */
  checkMessage(replica: Replica): Buffer {
    return replica.database ? (checkQuery ??= serialize.query(CHECK)) : serialize.query(CHECK_FIRST)
  }

  positionMessage(): Buffer {
    return this.database ? (positionQuery ??= serialize.query(POSITION)) : serialize.query(POSITION_FIRST)
  }
}

// Every name qualified and every operator spelled OPERATOR(pg_catalog.…): a session's code may have
// set search_path on the backend these run on, and what they answer is shared by every session.
const IDENTIFIER = ', (SELECT system_identifier FROM pg_catalog.pg_control_system())'
const CHECK_FIRST = `SELECT pg_catalog.concat_ws(' ', coalesce(CAST(pg_catalog.pg_last_wal_replay_lsn() AS pg_catalog.text), '-'), pg_catalog.pg_is_in_recovery(),
  CASE WHEN pg_catalog.pg_last_wal_receive_lsn() OPERATOR(pg_catalog.<=) pg_catalog.pg_last_wal_replay_lsn() THEN 0
  ELSE coalesce(pg_catalog.round(pg_catalog.date_part('epoch', pg_catalog.clock_timestamp() OPERATOR(pg_catalog.-) pg_catalog.pg_last_xact_replay_timestamp()) OPERATOR(pg_catalog.*) 1000), -1) END${IDENTIFIER})`
const CHECK = CHECK_FIRST.replace(IDENTIFIER, '')
const POSITION_FIRST = `SELECT pg_catalog.concat_ws(' ', pg_catalog.pg_current_wal_insert_lsn()${IDENTIFIER})`
const POSITION = POSITION_FIRST.replace(IDENTIFIER, '')
let checkQuery: Buffer | undefined
let positionQuery: Buffer | undefined

/** A setting a StartupMessage makes: its own parameter, else the last in `options` (`-c name=value`, `--name=value`), as Postgres applies them. */
function loginSetting(packet: Buffer, name: string): string | undefined {
  const params = parseStartupParams(packet.subarray(8))
  const options = [...(params.options ?? '').matchAll(new RegExp(`(?:^|\\s)(?:-c\\s*|--)${name.replaceAll('_', '[-_]')}=(\\S+)`, 'gi'))]
  return (params[name] ?? options.at(-1)?.[1])?.trim()
}

/** Whether a StartupMessage makes every transaction read-only (default_transaction_read_only). */
export const readOnlyLogin = (packet: Buffer) => /^(on|true|yes|1)$/i.test(loginSetting(packet, 'default_transaction_read_only') ?? '')

/** Whether a StartupMessage makes every transaction serializable, which a standby cannot run. */
export const serializableLogin = (packet: Buffer) => /^serializable$/i.test(loginSetting(packet, 'default_transaction_isolation') ?? '')
