/**
 * POST /sql with replicas: a batch sent `readOnly` and, by default, an autocommit read (one
 * statement, or a batch of reads) run on a replica, once it has replayed the position the request
 * names (its Edgepg-Last-Write header) and any the proxy told; else, or if the standby refuses it as
 * a write (25006), on the primary. Either way the answer tells the position it was read at or
 * written to, in the same header. The replica is asked in the same write as the request's
 * statements, the primary behind them: no round trip of its own, unless the request waits for a
 * replica to catch up.
 */
import type { DatabaseError } from 'pg-protocol'
import { ClaimsError } from '../auth/claims'
import { later } from '../../src/positions'
import { lsnText, positionOf } from './positions'
import type { HostPort } from '../upstream/address'
import type { Reading } from '../isolation/reader'
import type { Control, Credentials, Lease, Leases } from '../sql/lease'
import type { Response } from '../sql/run'
import { downForAll, recheckIn, type Fallback, type Replica, type Replicas } from './replicas'

export const POSITION_HEADER = 'edgepg-last-write'

/** The request's statements, as the proxy reads them, and whether it asked for a read-only transaction. */
export interface Asked {
  texts: string[]
  batch: boolean
  readOnly: boolean
}

/** Runs the request where it may (see above); `run` runs it on a lease. */
export async function runRouted(
  set: Replicas,
  leases: Leases,
  primary: HostPort,
  credentials: Credentials,
  ctl: Control,
  asked: Asked,
  after: string | undefined,
  read: (sql: string) => Reading,
  run: (lease: Lease) => Promise<Response>
): Promise<Response> {
  // (Undefined while the primary's database is not known: the replica's check then says it.)
  const names = later(after) !== ''
  const need = () => (set.database ? positionOf(after, set.database) : names ? undefined : 0n)
  const readings = asked.texts.map(read)
  const reads = readings.every((r) => !r.writes && r.plain && !r.unseen && !r.control && !r.signals)
  // (A token's claims go to a standby vouched for by the replica key, once a request or session of the role has learnt it on the primary.)
  const { conn, claims } = credentials
  const claimsKey = claims === undefined ? undefined : set.claimsKey(conn.user!, conn.database || conn.user!)
  const to = claimsKey && !claimsKey.key ? 'primary' : asked.readOnly && asked.batch ? 'replica' : set.o.autocommit && reads ? 'autocommit' : 'primary'
  if (to !== 'primary') {
    const replica = set.choose()
    const answer = typeof replica === 'string' ? replica : await tryReplica(set, replica, leases, credentials, ctl, need, run, to === 'autocommit', claimsKey?.key)
    if (typeof answer !== 'string') return set.events.routed('replica'), answer
    set.events.fellBack(answer)
  }
  set.events.routed('primary')
  return leases.with(primary, credentials, ctl, async (lease) => {
    const running = run(lease)
    // (Queued in the same write as the request's statements, behind them.)
    let answer = ''
    const asking = lease.statements.execute(set.position(), [], (row) => void (answer = row[0] ?? '')).catch(() => undefined)
    const response = await running
    await asking
    return withPosition(response, set, set.primaryAnswer(answer))
  }, { learn: claimsKey })
}

/**
 * The request on `replica`, once it has replayed what the request must see: it waits for that with no
 * backend held (asking again after recheckIn) for up to --replica-wait. Or why it runs on the primary
 * instead (`autocommit`: a read the standby may refuse as a write, 25006).
 */
async function tryReplica(set: Replicas, replica: Replica, leases: Leases, credentials: Credentials, ctl: Control, need: () => bigint | undefined, run: (lease: Lease) => Promise<Response>, autocommit: boolean, replicaKey?: Buffer): Promise<Response | Fallback> {
  const since = performance.now()
  for (let tries = 0; ; tries++) {
    let leased = false
    try {
      return await leases.with(replica.target, credentials, ctl, (lease) => ((leased = true), onReplica(set, replica, lease, need, run, tries ? since : 0)), { replicaKey })
    } catch (err) {
      if (err instanceof ClaimsError) return 'refused' // (the standby refused the token's claims: the request reads where they are set)
      const left = since + set.o.waitMs - performance.now()
      if (err instanceof NotYet && left > 0 && !ctl.aborted) {
        await new Promise((resolve) => setTimeout(resolve, recheckIn(tries, left)))
        continue
      }
      const code = (err as DatabaseError).code
      // (Postgres refused this login there, for what it asks: the request's, not the replica's for all; unless it serves no one.)
      const atLogin = !leased && (err as DatabaseError).severity !== undefined
      const why: Fallback | undefined = atLogin
        ? downForAll(code ?? '') ? 'down' : 'refused'
        : err instanceof NotYet || err instanceof Behind ? 'position'
        : err instanceof Lagging ? 'lag'
        : err instanceof CheckFailed ? 'check_failed'
        : code === '25006' && autocommit ? 'read_only'
        : replicaFailed(err) ? 'down'
        : undefined
      if (!why) throw err
      if (why === 'down') set.down(replica, (err as Error).message)
      return why
    }
  }
}

/** The replica had not replayed what the request must see within --replica-wait. */
class Behind extends Error {}
/** The replica has not replayed it yet: asked again, while --replica-wait allows. */
class NotYet extends Error {}
/** The replica lags more than --replica-max-lag. */
class Lagging extends Error {}
/** Postgres refused the check on the replica for this login (a role serializable by default): the replica is not down. */
class CheckFailed extends Error {}

/** A login or a connection to the replica failed (HTTP 502/503 from the lease), not the request. */
const replicaFailed = (err: unknown) => [502, 503].includes((err as { status?: number }).status ?? 0) || (err as Error).message === 'Connection terminated unexpectedly'

/** The request on the replica, once it has replayed what it must see; `waitedSince`: when the request began to wait for it, if it did. */
async function onReplica(set: Replicas, replica: Replica, lease: Lease, needed: () => bigint | undefined, run: (lease: Lease) => Promise<Response>, waitedSince: number): Promise<Response> {
  const check = async () => {
    let answer = ''
    set.events.checked()
    await lease.statements.execute(set.check(replica), [], (row) => void (answer = row[0] ?? '')).catch((err: DatabaseError) => {
      throw err.code ? new CheckFailed(err.message) : err
    })
    const { replayed, serves, lagging } = set.observe(replica, answer)
    if (!serves) throw Object.assign(new Error(`replica ${replica.name} ${replica.why}`), { status: 503 })
    if (lagging) throw new Lagging()
    return replayed
  }
  const need = needed()
  // (Behind a reset Postgres may refuse, which skips only the check's Sync group: the read waits for its answer.)
  if (need === undefined || replica.replayed < need || lease.handover) {
    // Behind, or not known not to be: asked first.
    if ((await check()) < (needed() ?? Infinity)) throw new NotYet()
    if (waitedSince) set.events.waited((performance.now() - waitedSince) / 1000)
  }
  const checking = check()
  const running = run(lease)
  const replayed = await checking.catch((err) => running.catch(() => {}).then(() => Promise.reject(err)))
  if (replayed < needed()!) throw (await running.catch(() => {}), new Behind())
  return withPosition(await running, set, replayed)
}

/** The response, with the position it was read at or written to. */
function withPosition(response: Response, set: Replicas, at: bigint | undefined): Response {
  if (at === undefined || !set.database) return response
  return { ...response, headers: { ...response.headers, [POSITION_HEADER]: `${set.database}:${lsnText(at)}` } }
}
