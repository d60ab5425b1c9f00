/**
 * What every runtime's run of the shared checks (checks.js) must have seen; used by
 * test/runtimes.test.ts and test/browser.test.ts. `context` (e.g. the page's console errors) is
 * appended to each message, so that a failure says what the runtime reported.
 */
import assert from 'node:assert/strict'
import { same } from '../support/helpers'
import { WEB_USER } from '../support/tokens'

/** `endToEnd`: the runtime could load client-side SCRAM on first use (import()); `replica`: the checks read from a replica. */
export function assertChecks(out: any, runtime: string, context = '', endToEnd = true, replica = true) {
  const more = context ? `\n${context}` : ''
  assert.equal(out.globalWebSocket, 'function', `${runtime}: a global WebSocket${more}`)
  assert.equal(out.node, false, `${runtime}: not running under Node${more}`)
  same(out.client, [{ greeting: 'hi', four: 4, who: 'scram_user' }], `${runtime}: Client query${more}`)
  same(out.pool, [{ n: 42 }, { who: 'md5_user' }], `${runtime}: Pool queries${more}`)
  assert.ok(out.login?.taken === true, `${runtime}: the proxy took the login from the upgrade; got ${JSON.stringify(out.login)}${more}`)
  // (In transaction pooling processID is the session's, not a backend's: test/process-id.test.ts.)
  same(out.login.rows, [{ seven: 7 }], `${runtime}: the query sent before connect() resolved${more}`)
  assert.ok(Number.isInteger(out.login.processID) && out.login.processID > 0, `${runtime}: processID set by connect(): ${out.login.processID}`)
  same(out.wrongPassword, { databaseError: true, code: '28P01', severity: 'FATAL', message: 'password authentication failed for user "scram_user"' }, `${runtime}: a wrong password rejects connect() with Postgres's DatabaseError${more}`)
  same(out.endToEnd, endToEnd ? [{ who: 'scram_user' }] : undefined, `${runtime}: SCRAM in the client (authOffload: false)${more}`)
  same(
    out.moduleScope,
    { sequential: [[1, 101], [2, 102]], concurrent: [[3, 103], [4, 104], [5, 105]], aborted: 'AbortError', after: [{ six: 6 }] },
    `${runtime}: a Pool kept across requests, and a query stopped by an AbortSignal${more}`
  )
  same(out.http, { template: [{ ten: 10, s: 'a b' }], query: [{ joined: 'edgepg' }] }, `${runtime}: httpSql over POST /sql${more}`)
  const as = (sub: string) => [{ sub, who: WEB_USER, owners: [sub] }]
  const listen = { heard: { channel: 'user:alice', payload: 'for alice' }, refused: '42501' }
  same(out.tokens, { alice: as('alice'), bob: as('bob'), http: as('bob'), listen }, `${runtime}: logins by token (Client and httpSql), each user their own rows; LISTEN where the policy allows${more}`)
  if (replica) assertReplicaReads(out.replica, runtime, more)
}

/** The replica checks: each read on the replica and not older than the write before it. */
function assertReplicaReads(r: any, runtime: string, more: string) {
  const position = /^\d+:([0-9A-F]+)\/([0-9A-F]+)$/
  assert.match(r?.afterClient ?? '', position, `${runtime}: config.lastWrite holds the position told after the Client's write: ${JSON.stringify(r)}${more}`)
  assert.match(r.afterHttp, position, `${runtime}: config.lastWrite after httpSql's write${more}`)
  const lsn = (text: string) => text.replace(position, (_, hi, lo) => (BigInt(`0x${hi}`) << 32n) + BigInt(`0x${lo}`) + '')
  assert.ok(BigInt(lsn(r.afterHttp)) > BigInt(lsn(r.afterClient)), `${runtime}: httpSql's write moved config.lastWrite on (the Edgepg-Last-Write header was read): ${r.afterClient} → ${r.afterHttp}${more}`)
  same(r.read, [{ n: r.written, replica: true }], `${runtime}: another Client's read right after the write, on the replica, sees it${more}`)
  // (edgepg.v4 would send the position in a message of its own ahead of the query's, which Nagle's algorithm holds back ~40 ms in Deno.)
  assert.equal(r.protocol, 'edgepg.v5', `${runtime}: the reader told its position in the query's own WebSocket message (edgepg.v5)${more}`)
  same(r.httpRead, [{ n: r.httpWritten, replica: true }], `${runtime}: httpSql's read right after its write, on the replica, sees it${more}`)
}
