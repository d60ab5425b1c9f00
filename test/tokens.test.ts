/**
 * Logins by signed token (issue 22): a token names a role, the proxy logs in as it and hands
 * Postgres the token's claims, which RLS policies read with edgepg.claims(). Against the real proxy
 * and Postgres, in both pool modes, over WebSocket sessions and /sql.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { WebSocket } from 'ws'
import { Client, Pool, httpSql, type ClientConfig } from '../src/index'
import http from 'node:http'
import { spawn } from 'node:child_process'
import { mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import type { AddressInfo } from 'node:net'
import { exportJWK, exportSPKI, generateKeyPair, SignJWT, UnsecuredJWT } from 'jose'
import { neon, neonConfig } from '@neondatabase/serverless'
import { startProxy, eventually, within, testPostgres } from './support/helpers'
import { AUDIENCE, claimsAttacks, ISSUER, SECRET, superuserUrl, token, tokenFixture, WEB_ADMIN, WEB_USER } from './support/tokens'
import { parseConfig } from '../proxy/config'
import { startPostgres } from './support/stack'

const TABLE = `notes_${process.pid}`
let fx: Awaited<ReturnType<typeof tokenFixture>>
before(async () => (fx = await tokenFixture(TABLE)))
after(() => fx?.teardown())

type Proxy = Awaited<ReturnType<typeof startProxy>>
const tokenProxy = (mode: 'session' | 'transaction', size = 2) => startProxy({ tokens: fx.options, pool: { mode, size, timeoutMs: 2000 } })

/** An edgepg Client logging in by `authToken`, with no password anywhere. */
function tokenClient(p: Proxy, authToken: ClientConfig['authToken'], extra: ClientConfig = {}) {
  const { host, port, database } = testPostgres()
  const client = new Client({ host, port, database, authToken, webSocketConstructor: WebSocket as any, wsProxy: () => p.url, ...extra })
  client.on('error', () => {})
  return client
}

async function as(p: Proxy, sub: string, role?: string) {
  const client = tokenClient(p, await token(sub, { role }))
  await client.connect()
  return client
}

/** Whose rows the session sees. */
const owners = async (c: Client) => (await c.query(`SELECT DISTINCT owner FROM ${TABLE} ORDER BY owner`)).rows.map((r) => r.owner)
const sub = async (c: Client) => (await c.query(`SELECT edgepg.claims() ->> 'sub' AS sub`)).rows[0].sub

for (const mode of ['transaction', 'session'] as const) {
  test(`${mode} mode: each user sees their own rows, and the role the token names`, async () => {
    const p = await tokenProxy(mode, 1)
    try {
      const alice = await as(p, 'alice')
      assert.deepEqual(await owners(alice), ['alice'])
      assert.equal((await alice.query('SELECT current_user AS u')).rows[0].u, WEB_USER)
      await alice.query(`INSERT INTO ${TABLE} (body) VALUES ('from alice')`)
      await assert.rejects(alice.query(`INSERT INTO ${TABLE} (owner, body) VALUES ('bob', 'forged')`), { code: '42501' })
      if (mode === 'session') await alice.end()
      // One backend (pool size 1): bob runs where alice ran, and sees none of hers.
      const bob = await as(p, 'bob', WEB_ADMIN)
      assert.deepEqual(await owners(bob), ['bob'])
      assert.equal((await bob.query('SELECT current_user AS u')).rows[0].u, WEB_ADMIN)
      if (mode === 'transaction') {
        // Interleaved on the one backend: each statement sees its own session's claims.
        for (let i = 0; i < 3; i++) {
          assert.equal(await sub(alice), 'alice')
          assert.equal(await sub(bob), 'bob')
        }
        assert.equal((await alice.query(`SELECT count(*)::int AS n FROM ${TABLE} WHERE body = 'from alice'`)).rows[0].n > 0, true)
        await alice.end()
      }
      await bob.end()
    } finally {
      await p.close()
    }
  })
}

const ATTACKS = claimsAttacks(TABLE)

async function checkAlice(c: Client, when: string) {
  assert.equal(await sub(c), 'alice', `claims after: ${when}`)
  assert.deepEqual(await owners(c), ['alice'], `rows after: ${when}`)
}

test("a token holder cannot change her claims, become someone else, or see another's rows (WebSocket, both modes)", async () => {
  for (const mode of ['transaction', 'session'] as const) {
    const p = await tokenProxy(mode, 2)
    try {
      const bob = await as(p, 'bob') // (holds claims of his own on a backend, meanwhile)
      await bob.query('BEGIN')
      assert.equal(await sub(bob), 'bob')
      const alice = await as(p, 'alice')
      for (const attack of ATTACKS) {
        await alice.query(attack).catch(() => {})
        await alice.query('ROLLBACK').catch(() => {})
        await checkAlice(alice, `${mode}: ${attack}`)
      }
      // Nothing of bob's claims, or of any token, shows in what sessions may read.
      const seen = await alice.query(`SELECT coalesce(query, '') || ' ' || coalesce(application_name, '') AS text FROM pg_stat_activity`)
      for (const { text } of seen.rows) assert.ok(!/bob|eyJ/.test(text), `pg_stat_activity shows ${text}`)
      const settings = await alice.query(`SELECT name, setting FROM pg_settings WHERE setting LIKE '%bob%' OR setting LIKE '%eyJ%'`)
      assert.deepEqual(settings.rows, [])
      assert.equal(await sub(bob), 'bob')
      await bob.query('COMMIT')
      await Promise.all([alice.end(), bob.end()])
    } finally {
      await p.close()
    }
  }
})

/**
 * Issue 46's attack, by a token user: code of the database's, run by a statement every reading calls
 * plain (the reader here says so of everything), forges what the proxy once asked and plants a
 * temporary table under the notes' name, behind search_path. The next token user on the one backend
 * reads her own rows, and writes into the real table.
 */
test("a token user who plants a table under the notes' name and forges the old verification: the next user on the backend reads and writes only their own rows", async () => {
  const NOTHING = { plain: true, code: false, unseen: false, control: false }
  const p = await startProxy({ tokens: fx.options, pool: { mode: 'transaction', size: 1, timeoutMs: 2000, reader: () => NOTHING } })
  const plant = `${TABLE}_plant`
  await fx.admin.query(`CREATE FUNCTION ${plant}() RETURNS int LANGUAGE plpgsql AS $f$ BEGIN
    EXECUTE 'DEALLOCATE ALL'; EXECUTE 'PREPARE edgepg_verify_forged AS SELECT ''statements 0''';
    PERFORM set_config('search_path', 'pg_temp, public', false);
    EXECUTE 'CREATE TEMP TABLE ${TABLE} (id int, owner text DEFAULT ''mallory'', body text)';
    EXECUTE 'INSERT INTO ${TABLE} VALUES (0, ''bob'', ''planted'')';
    EXECUTE 'LISTEN forged'; PERFORM pg_advisory_lock(4646464); RETURN 1; END $f$`)
  try {
    const mallory = await as(p, 'alice')
    const pid = (await mallory.query('SELECT pg_backend_pid() AS pid')).rows[0].pid
    await mallory.query(`SELECT ${plant}()`)
    assert.deepEqual((await mallory.query(`SELECT body FROM ${TABLE}`)).rows, [{ body: 'planted' }], 'the plant took, in her session')
    const bob = await as(p, 'bob')
    assert.equal((await bob.query('SELECT pg_backend_pid() AS pid')).rows[0].pid, pid, "bob runs on mallory's backend")
    assert.equal(await sub(bob), 'bob')
    assert.deepEqual((await bob.query(`SELECT owner, body FROM ${TABLE} ORDER BY id`)).rows, [{ owner: 'bob', body: "bob's note" }])
    const left = await bob.query(`SELECT current_setting('search_path') AS sp, (SELECT count(*)::int FROM pg_prepared_statements) AS prepared,
      (SELECT count(*)::int FROM pg_listening_channels()) AS listens, (SELECT count(*)::int FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()) AS locks`)
    assert.deepEqual(left.rows[0], { sp: '"$user", public', prepared: 0, listens: 0, locks: 0 })
    const id = (await bob.query(`INSERT INTO ${TABLE} (body) VALUES ('from bob') RETURNING id`)).rows[0].id
    assert.deepEqual((await fx.admin.query(`SELECT owner, body FROM ${TABLE} WHERE id = $1`, [id])).rows, [{ owner: 'bob', body: 'from bob' }], 'in the real table')
    await Promise.all([mallory.end(), bob.end()])
  } finally {
    await p.close()
    await fx.admin.query(`DROP FUNCTION ${plant}()`)
  }
})

test('ALTER ROLE CURRENT_USER SET … does not reach the claims of later sessions of the role', async () => {
  const p = await tokenProxy('transaction', 1)
  try {
    const alice = await as(p, 'alice')
    await alice.query(`ALTER ROLE CURRENT_USER SET search_path = pg_temp, public`)
    await alice.query(`ALTER ROLE CURRENT_USER SET edgepg.claims = '{"sub":"bob"}'`).catch(() => {})
    await alice.query(`CREATE FUNCTION pg_temp.claims() RETURNS jsonb LANGUAGE sql AS $$ SELECT '{"sub":"bob"}'::jsonb $$`).catch(() => {})
    await alice.end()
    // Later sessions of the role (on a backend logged in anew, which takes the role's settings).
    await fx.admin.query(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1`, [WEB_USER])
    for (const who of ['alice', 'bob']) {
      const c = await as(p, who)
      assert.equal(await sub(c), who)
      assert.deepEqual(await owners(c), [who])
      await c.end()
    }
  } finally {
    await fx.admin.query(`ALTER ROLE ${WEB_USER} RESET ALL`)
    await p.close()
  }
})

test('claims with quotes, $$ and backslashes reach edgepg.claims() as they are', async () => {
  const p = await tokenProxy('transaction', 1)
  try {
    const odd = `o'hara $$ "x" \\ $q$ ); SELECT 1 --`
    const c = tokenClient(p, await token(odd, { extra: { groups: ["a'b", '$$'] } }))
    await c.connect()
    assert.equal(await sub(c), odd)
    assert.deepEqual((await c.query(`SELECT edgepg.claims() -> 'groups' AS g`)).rows[0].g, ["a'b", '$$'])
    await c.end()
  } finally {
    await p.close()
  }
})

/** Tokens refused, each with the check its error must name. */
async function badTokens(): Promise<Array<{ what: string; jwt: string; says: RegExp; code?: string }>> {
  const now = Math.floor(Date.now() / 1000)
  return [
    { what: 'expired', jwt: await token('alice', { seconds: -60 }), says: /expired at/ },
    { what: 'not yet valid', jwt: await token('alice', { nbf: now + 600 }), says: /not valid before/ },
    { what: 'wrong audience', jwt: await token('alice', { audience: 'another-app' }), says: /audience/ },
    { what: 'wrong issuer', jwt: await token('alice', { issuer: 'https://evil.test/' }), says: /issuer/ },
    { what: 'bad signature', jwt: await token('alice', { secret: new TextEncoder().encode('not the secret of the tests, but as long') }), says: /signature does not verify/, code: '28P01' },
    { what: 'role not listed', jwt: await token('alice', { role: 'postgres' }), says: /role "postgres" is not one a token may use/ },
    { what: 'no role claim', jwt: await token('alice', { role: null }), says: /no "role" claim/ },
    { what: 'malformed', jwt: 'abc.def.ghi', says: /malformed/ },
    { what: 'alg none', jwt: new UnsecuredJWT({ sub: 'alice', role: WEB_USER }).setAudience(AUDIENCE).setIssuer(ISSUER).setExpirationTime(now + 300).encode(), says: /algorithm is not allowed|malformed/ },
    { what: 'no exp', jwt: await new SignJWT({ sub: 'alice', role: WEB_USER }).setProtectedHeader({ alg: 'HS256' }).setAudience(AUDIENCE).setIssuer(ISSUER).sign(SECRET), says: /no expiry/ },
  ]
}

test('bad tokens get a DatabaseError naming the failed check (never the token); over /sql, 401 with the same message; nothing logs a token', async () => {
  const logs: unknown[] = []
  const p = await startProxy({ tokens: fx.options, log: (e) => logs.push(e), sqlLog: (e) => logs.push(e) })
  try {
    const cases = await badTokens()
    for (const { what, jwt, says, code = '28000' } of cases) {
      const c = tokenClient(p, jwt)
      const err: any = await c.connect().then(() => assert.fail(`${what}: connected`), (e) => e)
      assert.equal(err.code, code, `${what}: ${err.message}`)
      assert.match(err.message, says, what)
      assert.ok(!err.message.includes(jwt), `${what}: the message quotes the token`)
      const sql = httpSql(`postgres://${testPostgres().host}:${testPostgres().port}/${testPostgres().database}`, { fetchEndpoint: `http://127.0.0.1:${p.port}/sql`, authToken: jwt })
      const httpErr: any = await sql.query('SELECT 1').then(() => assert.fail(`${what}: /sql answered`), (e) => e)
      assert.equal(httpErr.status, 401, `${what} over /sql: ${httpErr.message}`)
      assert.match(httpErr.message, says, `${what} over /sql`)
    }
    // A good one, to have logged a session and a request by token too.
    const good = await token('alice')
    const c = tokenClient(p, () => Promise.resolve(good))
    await c.connect()
    await c.end()
    await httpSql(`postgres://x@127.0.0.1/${testPostgres().database}`, { fetchEndpoint: `http://127.0.0.1:${p.port}/sql`, authToken: good }).query('SELECT 1')
    await eventually(() => logs.length >= cases.length * 2 + 2, 'every session and request logged')
    const text = JSON.stringify(logs)
    for (const jwt of [...cases.map((t) => t.jwt), good]) assert.ok(!text.includes(jwt), 'a token in the logs')
    // The sessions' outcomes say who refused: the proxy, not Postgres.
    const kinds = (logs as Array<{ kind?: string }>).filter((l) => 'kind' in l).map((l) => l.kind) // (sessions': /sql's have none)
    assert.deepEqual(kinds, [...cases.map(() => 'token_refused'), 'ok'])
  } finally {
    await p.close()
  }
})

test('exp and nbf have a leeway of 5 s (clocks differ a little), and no more', async () => {
  const p = await tokenProxy('transaction')
  try {
    const now = Math.floor(Date.now() / 1000)
    const late = tokenClient(p, await token('alice', { seconds: -3 }))
    await late.connect()
    assert.equal(await sub(late), 'alice')
    await late.end()
    const early = tokenClient(p, await token('alice', { nbf: now + 3 }))
    await early.connect()
    await early.end()
    await assert.rejects(tokenClient(p, await token('alice', { seconds: -8 })).connect(), /expired at/)
    await assert.rejects(tokenClient(p, await token('alice', { nbf: now + 8 })).connect(), /not valid before/)
  } finally {
    await p.close()
  }
})

test('a proxy without tokens configured refuses a login by token, clearly', async () => {
  const p = await startProxy()
  try {
    const err: any = await tokenClient(p, await token('alice')).connect().then(() => assert.fail('connected'), (e) => e)
    assert.equal(err.code, '28000')
    assert.match(err.message, /takes no tokens/)
  } finally {
    await p.close()
  }
})

test('a WebSocket session ends at its token’s exp (plus the leeway), with a clear error', async () => {
  for (const mode of ['transaction', 'session'] as const) {
    const p = await startProxy({ tokens: { ...fx.options, leewaySeconds: 1 }, pool: { mode } })
    try {
      const c = tokenClient(p, await token('alice', { seconds: 2 }))
      const ended = new Promise<any>((resolve) => c.on('error', resolve))
      await c.connect()
      assert.equal(await sub(c), 'alice')
      const err = await within(6000, 'the session to end at exp', ended)
      assert.equal(err.code, '28000', `${mode}: ${err.message}`)
      assert.match(err.message, /token expired at/)
      await assert.rejects(c.query('SELECT 1'))
    } finally {
      await p.close()
    }
  }
})

test('/sql by token: single queries, batches and Pool.query over HTTP run as the token says, and cannot change it', async () => {
  for (const mode of ['transaction', 'session'] as const) {
    const p = await tokenProxy(mode, 2)
    try {
      const { host, port, database } = testPostgres()
      const conn = `postgres://${host}:${port}/${database}`
      const endpoint = `http://127.0.0.1:${p.port}/sql`
      const alice = httpSql(conn, { fetchEndpoint: endpoint, authToken: () => token('alice') })
      const bob = httpSql(conn, { fetchEndpoint: endpoint, authToken: () => token('bob') })
      const whose = async (sql: typeof alice) => (await sql.query(`SELECT DISTINCT owner FROM ${TABLE} ORDER BY owner`)).map((r: any) => r.owner)
      assert.deepEqual(await whose(alice), ['alice'])
      assert.deepEqual(await whose(bob), ['bob'])
      const claimed = `SELECT edgepg.claims() ->> 'sub' AS sub, current_user AS u`
      for (const attack of ATTACKS.filter((a) => !/^(BEGIN|ROLLBACK)/.test(a))) {
        await alice.query(attack).catch(() => {})
        // In a batch (one transaction), with the check right behind it.
        const batch = await alice.transaction((sql) => [sql`SELECT 1`, sql.query(claimed)]).catch(() => undefined)
        const after = await alice.transaction([alice.query(`SELECT set_config('edgepg.claims', '{"sub":"bob"}', true)`), alice.query(`RESET ROLE`), alice.query(claimed)])
        assert.deepEqual(after[2], [{ sub: 'alice', u: WEB_USER }], `${mode}, after ${attack}`)
        if (batch) assert.deepEqual(batch[1], [{ sub: 'alice', u: WEB_USER }])
        assert.deepEqual(await whose(alice), ['alice'], `${mode}, rows after ${attack}`)
        assert.deepEqual(await whose(bob), ['bob'])
      }
      // A Pool's query over HTTP carries the Pool's authToken too.
      const pool = new Pool({ host, port, database, authToken: () => token('bob'), queryViaHttp: { fetchEndpoint: endpoint } })
      assert.deepEqual((await pool.query(claimed)).rows, [{ sub: 'bob', u: WEB_USER }])
      await pool.end()
    } finally {
      await p.close()
    }
  }
})

test("neon() from @neondatabase/serverless, with authToken, against the proxy's /sql", async () => {
  const p = await tokenProxy('transaction')
  try {
    const { host, port, database } = testPostgres()
    neonConfig.fetchEndpoint = `http://127.0.0.1:${p.port}/sql`
    const sql = neon(`postgresql://authenticated@${host}:${port}/${database}`, { authToken: () => token('bob') })
    assert.deepEqual(await sql`SELECT DISTINCT owner FROM ${sql.unsafe(TABLE)}`, [{ owner: 'bob' }])
    assert.deepEqual(await sql`SELECT edgepg.claims() ->> 'sub' AS sub`, [{ sub: 'bob' }])
  } finally {
    await p.close()
  }
})

test('a pool of edgepg Clients by token: each connection asks for its token, warm backends never carry claims across', async () => {
  const p = await tokenProxy('session', 1)
  try {
    const { host, port, database } = testPostgres()
    let n = 0
    const users = ['alice', 'bob', 'alice', 'bob']
    const pool = new Pool({ host, port, database, max: 1, idleTimeoutMillis: 1, authToken: () => token(users[n++ % users.length]), webSocketConstructor: WebSocket as any, wsProxy: () => p.url })
    for (const who of users) {
      const c = await pool.connect()
      assert.equal(await sub(c as unknown as Client), who)
      c.release(true) // (a new connection, and token, for the next)
    }
    await pool.end()
  } finally {
    await p.close()
  }
})

test('JWKS: keys fetched and cached, a new kid fetched again once (rotation, no restart), not more often; HS256 with the public key refused', async () => {
  const key1 = await generateKeyPair('RS256', { extractable: true })
  const key2 = await generateKeyPair('ES256', { extractable: true })
  const key3 = await generateKeyPair('RS256') // (ahead: an RSA key takes a while to make, and the cooldown runs below)
  const served: object[] = [{ ...(await exportJWK(key1.publicKey)), kid: 'k1', alg: 'RS256', use: 'sig' }]
  let fetches = 0
  const jwks = http.createServer((_req, res) => {
    fetches++
    res.writeHead(200, { 'content-type': 'application/json' })
    res.end(JSON.stringify({ keys: served }))
  })
  await new Promise<void>((resolve) => jwks.listen(0, '127.0.0.1', resolve))
  const jwksUrl = `http://127.0.0.1:${(jwks.address() as AddressInfo).port}/.well-known/jwks.json`
  const p = await startProxy({ tokens: { ...fx.options, secret: undefined, jwksUrl, jwksCooldownMs: 3000 } })
  const signed = (key: CryptoKey, alg: string, kid: string) =>
    new SignJWT({ sub: 'alice', role: WEB_USER }).setProtectedHeader({ alg, kid }).setAudience(AUDIENCE).setIssuer(ISSUER).setExpirationTime('5m').sign(key)
  const connects = async (jwt: string) => {
    const c = tokenClient(p, jwt)
    await c.connect()
    const who = await sub(c)
    await c.end()
    return who
  }
  try {
    assert.equal(await connects(await signed(key1.privateKey, 'RS256', 'k1')), 'alice')
    assert.equal(await connects(await signed(key1.privateKey, 'RS256', 'k1')), 'alice')
    assert.equal(fetches, 1, 'cached')
    served.push({ ...(await exportJWK(key2.publicKey)), kid: 'k2', alg: 'ES256', use: 'sig' })
    const [k2, k3] = [await signed(key2.privateKey, 'ES256', 'k2'), await signed(key3.privateKey, 'RS256', 'k3')]
    await new Promise((r) => setTimeout(r, 3100)) // (past the cooldown since the first fetch)
    assert.equal(await connects(k2), 'alice')
    assert.equal(fetches, 2, 'an unknown kid: fetched again')
    const err: any = await connects(k3).then(() => assert.fail('k3 accepted'), (e) => e)
    assert.match(err.message, /key the issuer does not list/)
    assert.equal(fetches, 2, 'not fetched again within the cooldown')
    // HS/RS confusion: an HS256 token whose secret is the RSA public key, as text.
    const pem = new TextEncoder().encode(await exportSPKI(key1.publicKey))
    const confused = await new SignJWT({ sub: 'bob', role: WEB_USER }).setProtectedHeader({ alg: 'HS256', kid: 'k1' }).setAudience(AUDIENCE).setIssuer(ISSUER).setExpirationTime('5m').sign(pem)
    const err2: any = await connects(confused).then(() => assert.fail('HS256 accepted'), (e) => e)
    assert.match(err2.message, /algorithm is not allowed/)
  } finally {
    await p.close()
    jwks.close()
  }
})

/** Runs the built CLI (as the package ships it) with `args`; resolves with its exit code and output. */
function cli(args: string[]): Promise<{ code: number | null; out: string }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, ['dist/cli.mjs', ...args], { cwd: fileURLToPath(new URL('..', import.meta.url)) })
    let out = ''
    child.stdout.on('data', (d) => (out += d))
    child.stderr.on('data', (d) => (out += d))
    child.once('close', (code) => resolve({ code, out }))
  })
}

test('edgepg-proxy setup-auth: idempotent; --neon-compat adds auth.jwt() and auth.user_id(); an owner that may not read start times is told what to grant', async () => {
  for (let i = 0; i < 2; i++) {
    const { code, out } = await cli(['setup-auth', superuserUrl()])
    assert.equal(code, 0, out)
    assert.match(out, /installed the schema edgepg/)
  }
  const compat = await cli(['setup-auth', superuserUrl(), '--neon-compat'])
  assert.equal(compat.code, 0, compat.out)
  assert.match(compat.out, /auth\.jwt\(\), auth\.user_id\(\)/)
  const p = await tokenProxy('transaction')
  try {
    const c = await as(p, 'alice')
    assert.deepEqual((await c.query(`SELECT auth.user_id() AS id, auth.jwt() ->> 'role' AS role`)).rows, [{ id: 'alice', role: WEB_USER }])
    assert.deepEqual(await owners(c), ['alice'])
    await c.end()
  } finally {
    await p.close()
    await fx.admin.query('DROP SCHEMA IF EXISTS auth CASCADE')
  }
  // A role that may not read other sessions' start times: nothing is installed, and it is told why.
  await fx.admin.query(`DROP ROLE IF EXISTS edgepg_setup_plain; CREATE ROLE edgepg_setup_plain LOGIN PASSWORD 'plain-pw'`)
  try {
    const { host, port, database } = testPostgres()
    const refused = await cli(['setup-auth', `postgres://edgepg_setup_plain:plain-pw@${host}:${port}/${database}`])
    assert.equal(refused.code, 2, refused.out)
    assert.match(refused.out, /setup-auth failed: edgepg_setup_plain may not read other sessions' start times: GRANT pg_read_all_stats TO "edgepg_setup_plain"/)
    // A URL without the password the database asks for: said so, with the command's usage.
    const bare = await cli(['setup-auth', `postgres://edgepg_setup_plain@${host}:${port}/${database}`])
    assert.equal(bare.code, 2, bare.out)
    assert.equal(
      bare.out,
      `edgepg-proxy: setup-auth failed: the database asks for a password, and postgres://…@${host}:${port}/${database} has none\n` +
        'Usage: edgepg-proxy setup-auth postgres://<superuser>:<password>@<host>:<port>/<database> [--neon-compat]\n'
    )
  } finally {
    await fx.admin.query('DROP ROLE IF EXISTS edgepg_setup_plain')
  }
  const usage = await cli(['setup-auth'])
  assert.equal(usage.code, 2)
  assert.equal(usage.out, 'edgepg-proxy: setup-auth needs the database URL\nUsage: edgepg-proxy setup-auth postgres://<superuser>:<password>@<host>:<port>/<database> [--neon-compat]\n')
})

test('token flags and variables reach the proxy options; what is missing or contradictory is refused, naming the flag', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'edgepg-jwt-'))
  try {
    const secretFile = join(dir, 'jwt.key')
    await writeFile(secretFile, 'a secret of at least thirty-two bytes, for HS256\n')
    const base = ['--upstream', '127.0.0.1:5432']
    const tokensOf = (argv: string[], env: Record<string, string> = {}) => (parseConfig([...base, ...argv], env) as any).options.tokens
    assert.equal(tokensOf([]), undefined, 'no tokens unless asked')
    const hs = tokensOf(['--jwt-secret-file', secretFile, '--jwt-audience', 'app', '--jwt-roles', 'web_user,web_admin', '--passfile', '/etc/edgepg/pgpass'])
    assert.deepEqual({ ...hs, secret: Buffer.from(hs.secret).toString() }, {
      jwksUrl: undefined, secret: 'a secret of at least thirty-two bytes, for HS256', audience: 'app', issuer: undefined, roles: ['web_user', 'web_admin'], roleClaim: 'role', passfile: '/etc/edgepg/pgpass',
    })
    const jwks = tokensOf([], { EDGEPG_JWKS_URL: 'https://issuer.test/jwks.json', EDGEPG_JWT_AUDIENCE: 'app', EDGEPG_JWT_ISSUER: 'https://issuer.test/', EDGEPG_JWT_ROLES: 'web_user', EDGEPG_JWT_ROLE_CLAIM: 'db_role', PGPASSFILE: '/home/app/.pgpass' })
    assert.deepEqual(jwks, { jwksUrl: 'https://issuer.test/jwks.json', secret: undefined, audience: 'app', issuer: 'https://issuer.test/', roles: ['web_user'], roleClaim: 'db_role', passfile: '/home/app/.pgpass' })
    const refused = (argv: string[], message: RegExp) => assert.throws(() => parseConfig([...base, ...argv], {}), message)
    refused(['--jwks-url', 'https://i/j', '--jwt-secret-file', secretFile, '--jwt-audience', 'a', '--jwt-roles', 'r'], /--jwks-url and --jwt-secret-file: give one of them/)
    refused(['--jwks-url', 'https://i/j', '--jwt-audience', 'a'], /tokens need --jwt-roles/)
    refused(['--jwks-url', 'https://i/j', '--jwt-roles', 'r'], /tokens need --jwt-audience/)
    refused(['--jwks-url', 'ftp://i/j', '--jwt-audience', 'a', '--jwt-roles', 'r'], /--jwks-url must be an http\(s\):\/\/ URL/)
    await writeFile(secretFile, 'short')
    refused(['--jwt-secret-file', secretFile, '--jwt-audience', 'a', '--jwt-roles', 'r'], /at least 32 bytes, got 5/)
  } finally {
    await rm(dir, { recursive: true, force: true })
  }
})

test('a database without setup-auth: logins by token get an error naming it, over a WebSocket (both modes) and /sql', async () => {
  const db = await startPostgres({ name: 'no-setup-auth' })
  const dir = await mkdtemp(join(tmpdir(), 'edgepg-noauth-'))
  const admin = db.admin()
  try {
    await admin.connect()
    await admin.query(`SET password_encryption = 'scram-sha-256'; CREATE ROLE ${WEB_USER} LOGIN PASSWORD 'noauth-pw'`)
    const passfile = join(dir, 'pgpass')
    await writeFile(passfile, `${db.host}:${db.port}:*:${WEB_USER}:noauth-pw\n`, { mode: 0o600 })
    for (const mode of ['transaction', 'session'] as const) {
      const p = await startProxy({ upstream: `${db.host}:${db.port}`, tokens: { ...fx.options, passfile }, pool: { mode } })
      try {
        const c = new Client({ host: db.host, port: db.port, database: db.database, authToken: await token('alice'), webSocketConstructor: WebSocket as any, wsProxy: () => p.url })
        c.on('error', () => {})
        // Session mode sets the claims at login; transaction mode when the session first runs something.
        const err: any = await c.connect().then(() => c.query('SELECT 1')).then(() => assert.fail(`${mode}: ran without claims`), (e) => e)
        assert.equal(err.code, '28000', `${mode}: ${err.message}`)
        assert.match(err.message, /no edgepg functions for tokens: run edgepg-proxy setup-auth/)
        await c.end().catch(() => {})
        const httpErr: any = await httpSql(`postgres://${db.host}:${db.port}/${db.database}`, { fetchEndpoint: `http://127.0.0.1:${p.port}/sql`, authToken: await token('alice') })
          .query('SELECT 1')
          .then(() => assert.fail('/sql ran without claims'), (e) => e)
        assert.match(httpErr.message, /run edgepg-proxy setup-auth/)
      } finally {
        await p.close()
      }
    }
  } finally {
    await admin.end().catch(() => {})
    await db.stop()
    await rm(dir, { recursive: true, force: true })
  }
})

test('the client sends a token only where the proxy can take it, and says why not otherwise', async () => {
  const { host, port, database } = testPostgres()
  const refused = (extra: ClientConfig) => {
    const c = new Client({ host, port, database, authToken: () => 'a.b.c', webSocketConstructor: WebSocket as any, ...extra })
    c.on('error', () => {})
    return c.connect().then(() => assert.fail('connected'), (e: Error) => e.message)
  }
  // Plain ws:// to another machine: refused before any connection is made (192.0.2.1 is TEST-NET).
  assert.match(await refused({ wsProxy: () => 'ws://192.0.2.1:9/v2' }), /authToken needs edgepg-proxy, wss:\/\/ \(or this machine\)/)
  // authToken() failing: its error, named as authToken's.
  const c = new Client({ host, port, database, authToken: () => Promise.reject(new Error('signed out')), webSocketConstructor: WebSocket as any, wsProxy: () => 'ws://127.0.0.1:9/v2' })
  c.on('error', () => {})
  await assert.rejects(c.connect(), /edgepg: authToken: signed out/)
})

/** An HS256 token for alice with exactly `claims` on top (exp included: none is set otherwise). */
const withClaims = (claims: Record<string, unknown>, secret: Uint8Array = SECRET) =>
  new SignJWT({ sub: 'alice', role: WEB_USER, ...claims }).setProtectedHeader({ alg: 'HS256' }).setAudience(AUDIENCE).setIssuer(ISSUER).sign(secret)

test('exp far ahead: a session of a token good for 30 days stays open (setTimeout takes at most ~24.8 days); exp in milliseconds or past the year 9999 is refused, naming it, and the proxy goes on', async () => {
  const p = await tokenProxy('transaction')
  try {
    const now = Math.floor(Date.now() / 1000)
    const month = tokenClient(p, await withClaims({ exp: now + 30 * 86400 }))
    const ended = new Promise<Error>((resolve) => month.on('error', resolve))
    await month.connect()
    // (Closed "expired" within a few ms before; a robust margin.)
    const early = await Promise.race([ended, new Promise((r) => setTimeout(r, 1000, undefined))])
    assert.equal(early, undefined, `the session ended: ${(early as Error | undefined)?.message}`)
    assert.equal(await sub(month), 'alice')
    await month.end()
    const { host, port, database } = testPostgres()
    for (const exp of [Date.now() + 300_000, 1e13]) {
      const err: any = await tokenClient(p, await withClaims({ exp })).connect().then(() => assert.fail(`exp ${exp}: connected`), (e) => e)
      assert.equal(err.code, '28000', err.message)
      assert.match(err.message, /exp .* is past the year 9999: exp is in seconds since 1970, not milliseconds/)
      const sql = httpSql(`postgres://${host}:${port}/${database}`, { fetchEndpoint: `http://127.0.0.1:${p.port}/sql`, authToken: await withClaims({ exp }) })
      const httpErr: any = await sql.query('SELECT 1').then(() => assert.fail(`exp ${exp}: /sql answered`), (e) => e)
      assert.equal(httpErr.status, 401, httpErr.message)
    }
    const after = await as(p, 'alice')
    assert.equal(await sub(after), 'alice', 'the proxy still serves')
    await after.end()
  } finally {
    await p.close()
  }
})

test('a NUL (\\u0000) in claims, in a value or a name: refused with a clear message over /sql (401, no backend lost) and WebSockets (both modes)', async () => {
  const { host, port, database } = testPostgres()
  for (const mode of ['transaction', 'session'] as const) {
    const p = await tokenProxy(mode, 1)
    const discards = async () => (await p.metrics.registry.getSingleMetric('edgepg_proxy_pool_discards_total')!.get()).values[0]?.value ?? 0
    try {
      const endpoint = `http://127.0.0.1:${p.port}/sql`
      const conn = `postgres://${host}:${port}/${database}`
      assert.deepEqual(await httpSql(conn, { fetchEndpoint: endpoint, authToken: await token('alice') }).query(`SELECT edgepg.claims() ->> 'sub' AS sub`), [{ sub: 'alice' }])
      const exp = Math.floor(Date.now() / 1000) + 300
      for (const claims of [{ name: 'a\u0000b' }, { groups: ['x', '\u0000'] }, { 'odd\u0000name': 1 }]) {
        const jwt = await withClaims({ exp, ...claims })
        const httpErr: any = await httpSql(conn, { fetchEndpoint: endpoint, authToken: jwt }).query('SELECT 1').then(() => assert.fail(`${mode}: /sql answered`), (e) => e)
        assert.equal(httpErr.status, 401, `${mode}: ${httpErr.message}`)
        assert.match(httpErr.message, /claims hold a NUL character \(\\u0000\), which Postgres cannot store/)
        const c = tokenClient(p, jwt)
        const err: any = await c.connect().then(() => c.query('SELECT 1')).then(() => assert.fail(`${mode}: the session ran`), (e) => e)
        assert.equal(err.code, '28000', `${mode}: ${err.message}`)
        assert.match(err.message, /claims hold a NUL character/)
      }
      assert.deepEqual(await httpSql(conn, { fetchEndpoint: endpoint, authToken: await token('bob') }).query(`SELECT edgepg.claims() ->> 'sub' AS sub`), [{ sub: 'bob' }])
      assert.equal(await discards(), 0, `${mode}: no backend closed`)
    } finally {
      await p.close()
    }
  }
})

test('--jwt-secret-file: raw bytes (head -c 32 /dev/urandom) are the secret as they are; text is trimmed; both verify tokens at the proxy', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'edgepg-jwt-raw-'))
  try {
    const file = join(dir, 'jwt.key')
    // Starts with a space and ends with a newline, as random bytes may: trimmed, they would be another secret.
    const raw = Buffer.from([0x20, ...Array.from({ length: 30 }, (_, i) => (i * 151 + 7) % 256), 0x0a])
    const text = 'a secret of at least thirty-two bytes, for HS256'
    for (const [content, secret] of [[raw, raw], [Buffer.from(`${text}\n`), Buffer.from(text)]] as const) {
      await writeFile(file, content)
      const config = parseConfig(['--upstream', '127.0.0.1:5432', '--jwt-secret-file', file, '--jwt-audience', AUDIENCE, '--jwt-roles', WEB_USER], {})
      assert.ok(config !== 'help')
      assert.deepEqual(Buffer.from(config.options.tokens!.secret!), secret)
      const p = await startProxy({ tokens: { ...fx.options, secret: config.options.tokens!.secret } })
      try {
        const c = tokenClient(p, await token('alice', { secret }))
        await c.connect()
        assert.equal(await sub(c), 'alice')
        await c.end()
      } finally {
        await p.close()
      }
    }
  } finally {
    await rm(dir, { recursive: true, force: true })
  }
})

test('JWKS: while the issuer fails, unknown kids do not each fetch it (once per retry interval), and the refusal says the issuer is unreachable; a JWKS too large or with too many keys is not taken', async () => {
  const key = await generateKeyPair('ES256', { extractable: true })
  const jwk = { ...(await exportJWK(key.publicKey)), alg: 'ES256', use: 'sig' }
  let serve: (res: http.ServerResponse) => void = (res) => (res.writeHead(500), res.end('down'))
  let fetches = 0
  const jwks = http.createServer((_req, res) => (fetches++, serve(res)))
  await new Promise<void>((resolve) => jwks.listen(0, '127.0.0.1', resolve))
  const jwksUrl = `http://127.0.0.1:${(jwks.address() as AddressInfo).port}/jwks.json`
  const proxyOf = (retryMs: number) => startProxy({ tokens: { ...fx.options, secret: undefined, jwksUrl, jwksCooldownMs: 60_000, jwksRetryMs: retryMs } })
  const signed = (kid: string) => new SignJWT({ sub: 'alice', role: WEB_USER }).setProtectedHeader({ alg: 'ES256', kid }).setAudience(AUDIENCE).setIssuer(ISSUER).setExpirationTime('5m').sign(key.privateKey)
  const refusal = async (p: Proxy, kid: string) => {
    const c = tokenClient(p, await signed(kid))
    return c.connect().then(() => assert.fail(`${kid}: connected`), (e: any) => e)
  }
  let p = await proxyOf(60_000)
  try {
    for (let i = 0; i < 20; i++) {
      const err = await refusal(p, `made-up-${i}`)
      assert.equal(err.code, '08001', err.message)
      assert.match(err.message, /the issuer's keys \(JWKS\) could not be fetched \(HTTP 500/)
    }
    assert.equal(fetches, 1, 'one fetch while the issuer fails')
    await p.close()
    // Too large (2 MiB), or too many keys: not taken, whatever the issuer sends.
    const cases: Array<[(res: http.ServerResponse) => void, RegExp]> = [
      [(res) => (res.writeHead(200, { 'content-type': 'application/json' }), res.end(JSON.stringify({ keys: [{ ...jwk, kid: 'k' }], pad: 'x'.repeat(2 << 20) }))), /larger than 1048576 bytes/],
      [(res) => (res.writeHead(200, { 'content-type': 'application/json' }), res.end(JSON.stringify({ keys: Array.from({ length: 101 }, (_, i) => ({ ...jwk, kid: `k${i}` })) }))), /101 keys; at most 100/],
    ]
    for (const [how, says] of cases) {
      serve = how
      p = await proxyOf(0)
      assert.match((await refusal(p, 'k0')).message, says)
      await p.close()
    }
    serve = (res) => (res.writeHead(200, { 'content-type': 'application/json' }), res.end(JSON.stringify({ keys: [{ ...jwk, kid: 'k0' }] })))
    p = await proxyOf(0)
    const c = tokenClient(p, await signed('k0'))
    await c.connect()
    assert.equal(await sub(c), 'alice')
    await c.end()
  } finally {
    await p.close()
    jwks.close()
  }
})

test('`edgepg-proxy token` (the built CLI) mints a token the proxy takes: its role, its claims, its expiry', async () => {
  const dir = await mkdtemp(join(tmpdir(), 'edgepg-token-'))
  const p = await tokenProxy('transaction', 1)
  try {
    await writeFile(join(dir, 'jwt.key'), SECRET)
    const cli = fileURLToPath(new URL('../dist/cli.mjs', import.meta.url))
    const run = (args: string[], env: Record<string, string> = {}) =>
      new Promise<{ code: number | null; out: string; err: string }>((resolve) => {
        const child = spawn(process.execPath, [cli, 'token', ...args], { env: { PATH: process.env.PATH!, ...env } })
        let out = ''
        let err = ''
        child.stdout.on('data', (d) => (out += d))
        child.stderr.on('data', (d) => (err += d))
        child.on('close', (code) => resolve({ code, out, err }))
      })
    // The proxy's settings as an operator's environment file gives them; the token's own on the command line.
    const env = { EDGEPG_JWT_SECRET_FILE: join(dir, 'jwt.key'), EDGEPG_JWT_AUDIENCE: AUDIENCE, EDGEPG_JWT_ISSUER: ISSUER, EDGEPG_JWT_ROLES: `${WEB_USER},${WEB_ADMIN}` }
    const minted = await run(['--role', WEB_USER, '--claim', 'sub=alice', '--claim', 'tier:=3', '--ttl', '10m'], env)
    assert.equal(minted.code, 0, minted.err)
    const client = tokenClient(p, minted.out.trim())
    await client.connect()
    const { rows } = await client.query(`SELECT current_user AS u, edgepg.claims() AS c`)
    assert.equal(rows[0].u, WEB_USER)
    assert.equal(rows[0].c.sub, 'alice')
    assert.equal(rows[0].c.tier, 3)
    assert.ok(Math.abs(rows[0].c.exp - (Date.now() / 1000 + 600)) < 60, `exp ten minutes ahead, got ${rows[0].c.exp}`)
    assert.deepEqual(await owners(client), ['alice'])
    await client.end()

    const refused = await run(['--role', 'postgres', '--claim', 'sub=alice'], env)
    assert.equal(refused.code, 2)
    assert.match(refused.err, /--role postgres is not one of --jwt-roles .*: the proxy would refuse the token\nUsage: edgepg-proxy token --role/)
    const noSecret = await run(['--role', WEB_USER], { EDGEPG_JWT_AUDIENCE: AUDIENCE })
    assert.match(noSecret.err, /token needs --jwt-secret-file \(or EDGEPG_JWT_SECRET_FILE\)/)
  } finally {
    await p.close()
    await rm(dir, { recursive: true, force: true })
  }
})
