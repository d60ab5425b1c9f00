/**
 * Running a POST /sql request's statements on its backend and encoding the results as Neon's
 * protocol has them: a single statement, or a batch in one transaction, sent in one write and one
 * Sync group (one round trip to a Postgres however far; see pipelined). What the request sends first
 * rides in one write with its first statement: in transaction pooling, the reset of a backend that
 * changed hands (whatever the statements read like); in session pooling, the timeout, and the reset
 * rides behind the last.
 */
import { reseed } from '../isolation/verify'
import { DatabaseError } from 'pg-protocol'
import { setsCustomSetting } from '../pool/idle-watch'
import { read } from '../isolation/reader'
import type { Field } from './statements'
import type { Control, Lease } from './lease'
import { HttpError, ISOLATION_LEVELS, type Flags, type QueryData } from './request'
import { OID, textToJson, type ArrayType } from './json'

export interface RunLimits {
  /** Largest response body, in bytes (TooLarge past it). */
  maxResponse: number
  /** statement_timeout in ms (0: none). */
  statementTimeout: number
}

export interface Response {
  status: number
  body: string
  headers?: Record<string, string>
}

/** The response grew past its limit (HTTP 507). */
export class TooLarge extends Error {}

/** How long past statement_timeout the proxy waits before cancelling a statement itself. */
const TIMEOUT_GRACE_MS = 1000
/** A statement that may be a COPY (which nothing may follow in the pipe until it is over). */
const MAY_COPY = /copy/i
/** Array types learnt, per database, at most (then forgotten and learnt again). */
const MAX_LEARNT_TYPES = 10_000

/** Runs a request's statements; `types`: the array types learnt so far for its database. */
export async function runRequest(
  lease: Lease,
  ctl: Control,
  payload: { single?: QueryData; batch?: QueryData[] },
  flags: Flags,
  types: Map<number, ArrayType | null>,
  limits: RunLimits
): Promise<Response> {
  const { maxResponse, statementTimeout } = limits
  const { statements } = lease
  const budget = { used: 0 }
  // In one write with the first statement: the reset of a backend that changed hands (transaction
  // pooling, sent by Leases.with()), or the timeout (taken back by the reset behind); either is also
  // the ping a warm backend needs (one that died while idle never answers it: see Leases.with()).
  if (lease.timeoutSet) statements.query(`SET statement_timeout = ${statementTimeout}`).catch(() => {})
  else if (lease.unpinged && !lease.handover) statements.sync().catch(() => {})
  /** Session pooling: the reset, in the same write as the last statement (unless that may be a COPY: see Statements.execute). */
  const resetBehind = (last: string) => {
    // (Settled once both are answered: the pool's own reset must not start while an answer of these is still to come.)
    if (!lease.lender && !MAY_COPY.test(last)) lease.reset = Promise.allSettled([statements.query('DISCARD ALL'), statements.own(reseed())]).then((done) => done.every((d) => d.status === 'fulfilled') && statements.status === 'I')
  }
  if (payload.single) {
    const running = runStatement(lease, types, ctl, payload.single, flags, budget, limits, false)
    resetBehind(payload.single.query)
    const json = await running
    if (Buffer.byteLength(json) > maxResponse) throw new TooLarge()
    return { status: 200, body: json }
  }
  // A batch: one transaction; the first error rolls it back.
  const begin = ['BEGIN']
  if (flags.isolation) begin.push('ISOLATION LEVEL', ISOLATION_LEVELS[flags.isolation])
  if (flags.readOnly) begin.push('READ ONLY')
  if (flags.deferrable) begin.push('DEFERRABLE')
  const batch = payload.batch!
  try {
    const results = batch.every((q) => !MAY_COPY.test(q.query) && !(lease.lender?.read ?? read)(q.query).control)
      ? await pipelined(lease, ctl, begin.join(' '), (data, after) => runStatement(lease, types, ctl, data, flags, budget, limits, true, after), batch, () => resetBehind('COMMIT'))
      : await oneByOne(lease, ctl, begin.join(' '), (data) => runStatement(lease, types, ctl, data, flags, budget, limits, true), batch, () => resetBehind('COMMIT'))
    const json = `{"results":[${results.join(',')}]}`
    if (Buffer.byteLength(json) > maxResponse) throw new TooLarge()
    const headers: Record<string, string> = {}
    if (flags.isolation) headers['neon-batch-isolation-level'] = flags.isolation
    if (flags.readOnly) headers['neon-batch-read-only'] = 'true'
    if (flags.deferrable) headers['neon-batch-deferrable'] = 'true'
    return { status: 200, body: json, headers }
  } catch (err) {
    if (!ctl.tainted && statements.status !== 'I') await statements.query('ROLLBACK').catch(() => (ctl.tainted = true))
    throw err
  }
}

type Run = (data: QueryData, after?: Promise<unknown>) => Promise<string>

/**
 * A batch in one write and one Sync group (the reset of a backend that changed hands at its head):
 * one round trip to Postgres, however far it is. Postgres skips what follows an error; the first
 * error, in order, is the batch's.
 */
async function pipelined(lease: Lease, ctl: Control, begin: string, run: Run, batch: QueryData[], resetBehind: () => void): Promise<string[]> {
  if (ctl.aborted) throw new HttpError(499, 'client went away')
  const { statements } = lease
  // (A Sync group is one transaction by itself, rolled back whole at its Sync after an error: a
  // BEGIN and COMMIT only where the batch asks for more than that, an isolation level or read-only.)
  const explicit = begin !== 'BEGIN'
  statements.grouping = true
  let before: Promise<unknown> = explicit ? statements.query(begin) : Promise.resolve()
  const sent = [before]
  ctl.running = true
  for (const data of batch) sent.push((before = run(data, before)))
  sent.push(explicit ? statements.query('COMMIT') : Promise.resolve())
  statements.grouping = false
  sent.push(statements.sync())
  resetBehind()
  const settled = await Promise.allSettled(sent)
  ctl.running = false
  const failed = settled.find((s) => s.status === 'rejected')
  if (failed) throw (failed as PromiseRejectedResult).reason
  return settled.slice(1, -2).map((s) => (s as PromiseFulfilledResult<string>).value)
}

/** A batch one statement at a time, each after the answer to the one before: where one may end the transaction, or be a COPY that nothing may follow. */
async function oneByOne(lease: Lease, ctl: Control, begin: string, run: Run, batch: QueryData[], resetBehind: () => void): Promise<string[]> {
  const { statements } = lease
  // (In a Sync group of its own: the reset of a backend that changed hands, if any, leads it.)
  statements.grouping = true
  const begun = statements.query(begin)
  statements.grouping = false
  await Promise.all([begun, statements.sync()])
  const results: string[] = []
  for (const [i, data] of batch.entries()) {
    if (ctl.aborted) throw new HttpError(499, 'client went away')
    results.push(await run(data))
    if (statements.status === 'I') {
      throw new HttpError(400, `statement ${i + 1} of the batch ended its transaction; COMMIT, ROLLBACK and the like are not allowed in a batch`, '25000')
    }
  }
  if (ctl.aborted) throw new HttpError(499, 'client went away')
  const commit = statements.query('COMMIT')
  resetBehind()
  await commit
  return results
}

/** Runs one statement; resolves with its result as JSON text. */
async function runStatement(
  lease: Lease,
  types: Map<number, ArrayType | null>,
  ctl: Control,
  data: QueryData,
  flags: Flags,
  budget: { used: number },
  { maxResponse, statementTimeout }: RunLimits,
  inBatch: boolean,
  /** Pipelined behind another statement: its timer starts once that one is answered, and the batch keeps ctl.running. */
  after?: Promise<unknown>
): Promise<string> {
  const arrayMode = data.arrayMode ?? flags.arrayMode
  const rawRows: Array<Array<string | null>> = []
  const jsonRows: string[] = []
  let keys: string[] | undefined
  const charge = (bytes: number) => {
    budget.used += bytes
    if (budget.used > maxResponse && !ctl.tooLarge) {
      ctl.tooLarge = true
      ctl.cancel()
    }
  }
  const onRow = (row: Array<string | null>, fields: Field[]) => {
    if (ctl.tooLarge || ctl.aborted) return
    if (!flags.raw) {
      rawRows.push(row)
      let n = row.length + 2
      for (const v of row) if (v !== null) n += v.length
      return charge(n)
    }
    let json: string
    if (arrayMode) json = JSON.stringify(row)
    else {
      keys ??= fields.map((f) => JSON.stringify(f.name) + ':')
      json = '{' + row.map((v, i) => keys![i] + JSON.stringify(v)).join(',') + '}'
    }
    jsonRows.push(json)
    charge(Buffer.byteLength(json) + 1)
  }

  if (setsCustomSetting(data.query) || lease.lender?.read(data.query).unseen) lease.customSetting = true
  if (!after) ctl.running = true
  // Postgres's statement_timeout fires by itself for a lone statement it was SET for; the proxy's
  // timer is for a batch, whose statements may lift it (SET in a batch), and for where nothing was
  // SET, where it is the only one.
  let timer: NodeJS.Timeout | undefined
  let done = false
  const arm = () => {
    if (done || !(statementTimeout > 0 && (inBatch || !lease.timeoutSet))) return
    timer = setTimeout(() => {
      ctl.timedOut = true
      ctl.cancel()
    }, statementTimeout + (lease.timeoutSet ? TIMEOUT_GRACE_MS : 0))
  }
  after ? after.then(arm, arm) : arm()
  let result
  try {
    result = await lease.statements.execute(data.query, data.params, onRow)
  } catch (err) {
    if (!(err instanceof DatabaseError)) ctl.tainted = true // the connection broke
    if (ctl.tooLarge) throw new TooLarge()
    if (ctl.timedOut && err instanceof DatabaseError && err.code === '57014') {
      err.message = `canceling statement due to statement timeout (edgepg-proxy: ${statementTimeout} ms)`
    }
    throw err
  } finally {
    if (!after) ctl.running = false
    done = true
    clearTimeout(timer)
  }
  if (ctl.tooLarge) throw new TooLarge()

  const fields = result.fields.map((f) => ({ ...f, format: 'text' }))
  if (!flags.raw && rawRows.length) {
    await learnTypes(lease, types, fields.map((f) => f.dataTypeID))
    const oids = fields.map((f) => f.dataTypeID)
    keys = fields.map((f) => JSON.stringify(f.name) + ':')
    budget.used -= rawRows.reduce((n, row) => n + row.length + 2 + row.reduce((m: number, v) => m + (v === null ? 0 : v.length), 0), 0)
    for (const row of rawRows) {
      const values = row.map((v, i) => (v === null ? 'null' : textToJson(v, oids[i], types)))
      const json = arrayMode ? '[' + values.join(',') + ']' : '{' + values.map((v, i) => keys![i] + v).join(',') + '}'
      jsonRows.push(json)
      budget.used += Buffer.byteLength(json) + 1
    }
    if (budget.used > maxResponse) throw new TooLarge()
  }
  const head = `{"command":${JSON.stringify(result.command ?? '')},"rowCount":${result.rowCount ?? 'null'},"rowAsArray":${arrayMode},"fields":${JSON.stringify(fields)},"rows":[`
  charge(head.length + 2)
  if (ctl.tooLarge) throw new TooLarge()
  return head + jsonRows.join(',') + ']}'
}

/** Which of `oids` are array types (and of what), once per database, for non-raw output. */
async function learnTypes(lease: Lease, types: Map<number, ArrayType | null>, oids: number[]) {
  const unknown = [...new Set(oids)].filter((oid) => !types.has(oid) && !Object.values(OID).includes(oid))
  if (!unknown.length) return
  const rows: Array<Array<string | null>> = []
  await lease.statements.execute(
    `SELECT t.oid::int, t.typelem::int, e.typdelim::text FROM pg_type t JOIN pg_type e ON e.oid = t.typelem
     WHERE t.oid = ANY($1::oid[]) AND t.typcategory = 'A'`,
    [`{${unknown.join(',')}}`],
    (row) => void rows.push(row)
  )
  if (types.size + unknown.length > MAX_LEARNT_TYPES) types.clear()
  for (const oid of unknown) types.set(oid, null)
  for (const [oid, elem, delim] of rows) types.set(Number(oid), { elem: Number(elem), delim: delim! })
}
