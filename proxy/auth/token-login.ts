/**
 * A login by token: the role the token names, logged in with the password the proxy holds for it.
 * Used by the WebSocket routes and by /sql alike.
 */
import type { HostPort } from '../upstream/address'
import type { Login } from '../login/in-upgrade'
import { startupAs } from '../wire/startup'
import { Passfile } from './passfile'
import { TokenRefused, Tokens, type Identity, type TokenOptions } from './tokens'

export interface TokenLoginOptions extends TokenOptions {
  /** pgpass-format file with the roles' passwords (default: PGPASSFILE, else ~/.pgpass). */
  passfile?: string
}

export class TokenLogins {
  private readonly tokens: Tokens
  private readonly passfile: Passfile

  constructor(o: TokenLoginOptions) {
    this.tokens = new Tokens(o)
    this.passfile = new Passfile(o.passfile)
  }

  /** The identity `token` proves, and the password of its role for `database` (default: the role's name, as Postgres's) at `target`. */
  async identify(token: string, target: HostPort, database?: string): Promise<{ identity: Identity; password: string; database: string }> {
    const identity = await this.tokens.verify(token)
    database ||= identity.role
    const password = await this.passfile.password({ host: target.host, port: target.port, database, user: identity.role })
    if (password === undefined) throw new TokenRefused(`edgepg-proxy holds no password for role "${identity.role}": its passfile (--passfile) has none for this database`)
    return { identity, password, database }
  }

  /** `login` (a StartupMessage with a token) as a login of the token's role, with its password. */
  async login(login: Login & { first: { kind: 'startup' } }, target: HostPort): Promise<{ login: Login; identity: Identity }> {
    const { identity, password, database } = await this.identify(login.token!, target, login.first.database)
    const first = { ...login.first, user: identity.role, database, packet: startupAs(login.first.packet, identity.role) }
    return { login: { ...login, first, password, token: undefined }, identity }
  }
}
