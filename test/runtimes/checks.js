// The checks every runtime runs against the built bundle, as a plain script (no import/export) so
// that it loads both as an ES module (smoke.mjs, in Deno and Bun) and as a script evaluated in
// edge-runtime's EdgeVM (test/runtimes.test.ts). It defines globalThis.edgepgChecks(mod, options),
// which resolves with what it saw; `mod` is the bundle's exports, used with the runtime's own
// global WebSocket and fetch.
globalThis.edgepgChecks = async function edgepgChecks(mod, { proxyPort, host, port, database, password, dynamicImport = true, tokens, replica }) {
  const { Client, Pool, httpSql } = mod
  const base = (user) => ({ host, port, database, user, password, wsProxy: () => `ws://127.0.0.1:${proxyPort}/v2` })
  const plain = (rows) => JSON.parse(JSON.stringify(rows))
  const out = { globalWebSocket: typeof WebSocket, node: typeof process !== 'undefined' && !!process.versions?.node && !globalThis.Bun && !globalThis.Deno }

  // Client: connect, a parameterized query, end. scram_user exercises WebCrypto PBKDF2 (SCRAM).
  const client = new Client(base('scram_user'))
  await client.connect()
  const res = await client.query('SELECT $1::text AS greeting, 2 + 2 AS four, current_user AS who', ['hi'])
  out.client = plain(res.rows)
  await client.end()

  // Pool: query, end. md5_user exercises the bundled md5 (WebCrypto has none).
  const pool = new Pool({ ...base('md5_user'), max: 2 })
  const [a, b] = await Promise.all([pool.query('SELECT $1::int + 1 AS n', [41]), pool.query('SELECT current_user AS who')])
  out.pool = [...plain(a.rows), ...plain(b.rows)]
  await pool.end()

  // The login rides in the WebSocket upgrade: connect() resolves on Postgres's ReadyForQuery, with
  // processID known; a query issued meanwhile waits for it. A wrong password rejects connect()
  // with Postgres's own DatabaseError.
  const early = new Client(base('scram_user'))
  const connecting = early.connect()
  const first = early.query('SELECT 7 AS seven')
  await connecting
  out.login = { taken: early.connection.stream.loginTaken, processID: early.processID, rows: plain((await first).rows) }
  await early.end()
  const refused = new Client({ ...base('scram_user'), password: 'wrong-password' })
  out.wrongPassword = await refused.connect().then(
    () => 'connected',
    (e) => ({ databaseError: e instanceof mod.DatabaseError, code: e.code, severity: e.severity, message: e.message })
  )
  await refused.end().catch(() => {})

  // End to end (authOffload: false): the client runs SCRAM itself, with pg's SCRAM loaded on first
  // use (import()), which a script evaluated without a module loader cannot do.
  if (dynamicImport) {
    const own = new Client({ ...base('scram_user'), authOffload: false })
    await own.connect()
    out.endToEnd = plain((await own.query('SELECT current_user AS who')).rows)
    await own.end()
  }

  // A Pool kept across requests, as at module scope: several requests one after another and at
  // once, each a pool.query and a transaction on pool.connect(); then a query stopped by a signal
  // while it runs (cancelled on the server), after which the Pool serves on.
  const shared = new Pool({ ...base('scram_user'), max: 2 })
  const request = async (n) => {
    const c = await shared.connect()
    let rows
    try {
      await c.query('BEGIN')
      rows = (await c.query('SELECT $1::int AS n', [n])).rows
      await c.query('COMMIT')
    } finally {
      c.release()
    }
    return [rows[0].n, (await shared.query('SELECT $1::int + 100 AS m', [n])).rows[0].m]
  }
  const moduleScope = { sequential: [await request(1), await request(2)], concurrent: await Promise.all([3, 4, 5].map(request)) }
  const controller = new AbortController()
  const sleeping = shared.query({ text: 'SELECT pg_sleep(30)', signal: controller.signal })
  setTimeout(() => controller.abort(), 200)
  moduleScope.aborted = await sleeping.then(() => 'ran to the end', (e) => e === controller.signal.reason && e.name)
  moduleScope.after = plain((await shared.query('SELECT 6 AS six')).rows)
  await shared.end()
  out.moduleScope = moduleScope

  // HTTP: httpSql against the proxy's POST /sql, through the runtime's fetch.
  const sql = httpSql(`postgresql://scram_user:${encodeURIComponent(password)}@${host}:${port}/${database}`, {
    fetchEndpoint: `http://127.0.0.1:${proxyPort}/sql`,
  })
  const x = 5
  out.http = {
    template: plain(await sql`SELECT ${x}::int * 2 AS ten, ${'a b'}::text AS s`),
    query: plain(await sql.query('SELECT $1::text || $2::text AS joined', ['edge', 'pg'])),
  }

  // Logins by token, no password anywhere (a proxy started with tokens): each user gets the role
  // their token names and only their rows, over a WebSocket and over HTTP.
  if (tokens) {
    const probe = `SELECT edgepg.claims() ->> 'sub' AS sub, current_user AS who, (SELECT array_agg(DISTINCT owner ORDER BY owner) FROM ${tokens.table}) AS owners`
    out.tokens = {}
    for (const who of ['alice', 'bob']) {
      const c = new Client({ host, port, database, authToken: () => Promise.resolve(tokens[who]), wsProxy: () => `ws://127.0.0.1:${tokens.proxyPort}/v2` })
      await c.connect()
      out.tokens[who] = plain((await c.query(probe)).rows)
      await c.end()
    }
    const byToken = httpSql(`postgresql://${host}:${port}/${database}`, { fetchEndpoint: `http://127.0.0.1:${tokens.proxyPort}/sql`, authToken: tokens.bob })
    out.tokens.http = plain(await byToken.query(probe))

    // LISTEN by token through transaction pooling: where the proxy's --listen-policy allows, a NOTIFY
    // sent by another connection is heard; elsewhere the LISTEN is refused.
    const listener = new Client({ host, port, database, authToken: () => Promise.resolve(tokens.alice), wsProxy: () => `ws://127.0.0.1:${tokens.proxyPort}/v2` })
    await listener.connect()
    const heard = new Promise((resolve) => listener.once('notification', ({ channel, payload }) => resolve({ channel, payload })))
    await listener.query('LISTEN "user:alice"')
    const refused = await listener.query('LISTEN "user:bob"').then(() => 'no error', (err) => err.code)
    const sender = new Client({ host, port, database, user: 'scram_user', password, wsProxy: () => `ws://127.0.0.1:${proxyPort}/v2` })
    await sender.connect()
    await sender.query(`NOTIFY "user:bob", 'for bob'; NOTIFY "user:alice", 'for alice'`)
    await sender.end()
    out.tokens.listen = { heard: await heard, refused }
    await listener.end()
  }

  // Reads from a replica that lags (a proxy with --replica, before a primary of its own): a read
  // right after a write, by another Client and by httpSql, waits for the replica to replay it, as
  // the position the proxy told (a WebSocket text frame; a response header, exposed by CORS) says.
  if (replica) {
    const at = { host, port: replica.port, database, user: 'scram_user', password, wsProxy: () => `ws://127.0.0.1:${replica.proxyPort}/v2` }
    const update = `UPDATE ${replica.table} SET n = n + 1 WHERE id = 1 RETURNING n`
    const select = `SELECT n, pg_is_in_recovery() AS replica FROM ${replica.table} WHERE id = 1`
    const writer = new Client(at)
    await writer.connect()
    const written = (await writer.query(update)).rows[0].n
    await writer.end()
    const afterClient = mod.config.lastWrite
    const reader = new Client(at)
    await reader.connect()
    const read = plain((await reader.query(select)).rows)
    const protocol = reader.connection.stream.ws?.protocol
    await reader.end()
    const sql = httpSql(`postgresql://scram_user:${encodeURIComponent(password)}@${host}:${replica.port}/${database}`, { fetchEndpoint: `http://127.0.0.1:${replica.proxyPort}/sql` })
    const httpWritten = (await sql.query(update))[0].n
    out.replica = { afterClient, afterHttp: mod.config.lastWrite, written, read, protocol, httpWritten, httpRead: plain(await sql.query(select)) }
  }
  return out
}
