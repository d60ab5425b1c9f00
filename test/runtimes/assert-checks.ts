/**
 * What every runtime's run of the shared checks (checks.js) must have seen; used by
 * test/runtimes.test.ts and test/browser.test.ts. `context` (e.g. the page's console errors) is
 * appended to each message, so that a failure says what the runtime reported.
 */
import assert from 'node:assert/strict'
import { same } from '../support/helpers'
import { WEB_USER } from '../support/tokens'

/** `endToEnd`: the runtime could load client-side SCRAM on first use (import()). */
export function assertChecks(out: any, runtime: string, context = '', endToEnd = true) {
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
  same(out.tokens, { alice: as('alice'), bob: as('bob'), http: as('bob') }, `${runtime}: logins by token (Client and httpSql), each user their own rows${more}`)
}
